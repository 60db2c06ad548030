"""FQN globs of a family's parallel plan -> the submodules they name (one FQN atom per ``*``)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from dhp.errors import PlanError


def glob_match(fqn: str, glob: str) -> bool:
    """True when each dot-separated atom of ``fqn`` matches the same atom of ``glob`` (fnmatch)."""
    a, b = fqn.split("."), glob.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b, strict=True))


def match_plan(module: nn.Module, plan: Mapping[str, object]) -> dict[str, list[str]]:
    """Pure: for every submodule FQN of ``module``, the plan globs that match it (possibly none)."""
    return {fqn: [g for g in plan if glob_match(fqn, g)] for fqn, _ in module.named_modules() if fqn}


def matching(module: nn.Module, globs: Iterable[str]) -> list[tuple[str, nn.Module]]:
    """``(fqn, submodule)`` of every submodule that one of ``globs`` matches, in module order."""
    globs = tuple(globs)
    return [(fqn, m) for fqn, m in module.named_modules() if fqn and any(glob_match(fqn, g) for g in globs)]


def match_sites(module: nn.Module, sites: Iterable[Any]) -> list[tuple[Any, nn.Module]]:
    """``(site, attention module)`` for every module a site's ``modules`` glob matches; PlanError if a
    site matches nothing (a plan that names no module is a family bug, not a no-op)."""
    out = []
    for site in sites:
        found = matching(module, [site.modules])
        if not found:
            raise PlanError(
                f"attention site {site.modules!r} matches no submodule of {type(module).__name__}"
            )
        out += [(site, m) for _, m in found]
    return out
