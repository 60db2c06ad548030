"""Key paths against the schema (``dhp.config.schema.RunConfig``): is ``train.stesp`` a key, and if not,
which key was meant. Pure; walks the dataclasses' type hints.

Every override of a command line is checked before Hydra composes, so a run with three mistyped keys
gets three issues at once (Hydra stops at the first), each with the closest key of its section.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dhp.config.schema import RunConfig
from dhp.errors import ConfigIssue

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _inner(tp: Any) -> Any:
    """``X`` of ``X | None``; the type itself otherwise."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return tp


def unknown_key(path: str) -> tuple[str, list[str]] | None:
    """``(the section's key path, its keys)`` when ``path`` names no key of the schema, else None.

    Inside a ``dict[str, X]`` any name is a key (module names, ``extra`` numbers, ``columns``); inside a
    list or a plain value the rest of the path is not checked here (Hydra and validation report it)."""
    node: Any = RunConfig
    parts = path.split(".")
    for i, part in enumerate(parts):
        node = _inner(node)
        if dataclasses.is_dataclass(node):
            hints = _hints(node)
            if part not in hints:
                return ".".join(parts[:i]), sorted(hints)
            node = hints[part]
        elif typing.get_origin(node) is dict:
            node = typing.get_args(node)[1] if typing.get_args(node) else Any
        else:
            return None
    return None


def did_you_mean(path: str) -> str:
    """`` (did you mean train.steps?)`` for a mistyped key, or ``""`` when nothing is close."""
    found = unknown_key(path)
    if found is None:
        return ""
    section, keys = found
    name = path.split(".")[len(section.split(".")) if section else 0]
    close = difflib.get_close_matches(name, keys, n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {section + '.' if section else ''}{close[0]}?)"


def group_names() -> set[str]:
    """The config groups of ``conf/`` (``model=NAME``, ``cluster=NAME``, ...): overrides, not keys."""
    return {p.name for p in CONF_DIR.iterdir() if p.is_dir()} if CONF_DIR.is_dir() else set()


def override_key_issues(overrides: Iterable[str]) -> list[ConfigIssue]:
    """One issue per ``key=value`` override whose key the schema does not have (``+key`` appends and
    ``~key`` deletes are Hydra's business; a group choice such as ``model=tiny`` is not a key)."""
    groups = group_names()
    out = []
    for ov in overrides:
        key, eq, value = ov.partition("=")
        if not eq or key.startswith(("+", "~", "hydra.")) or key in groups or "[" in key:
            continue
        found = unknown_key(key)
        if found is None:
            continue
        section, keys = found
        where = f"'{section}'" if section else "the run config"
        name = key.split(".")[len(section.split(".")) if section else 0]
        out.append(
            ConfigIssue(
                path=key,
                value=value,
                rule=f"unknown key: {where} has no {name!r}{did_you_mean(key)}",
                fix=f"use one of the keys of {where}: {', '.join(keys)}",
            )
        )
    return out
