"""Model families by name, found on disk: ``dhp/models/<name>/family.py`` makes ``<name>`` a family.

A family folder may hold several flavours of one model (dense and MoE), chosen by the architecture
numbers; a flavour's own name (its released ``model_type``) is an alias of the folder, listed in
:data:`ALIASES`, so ``model.family: qwen3_vl_moe`` is the Qwen3-VL family held to its MoE flavour.

Torch-free: listing families and reading a family's ``arch.py`` (geometry, parameter counts) import
no torch, so the planner and config validation stay pure. :func:`get_family` imports the family's
``family.py`` (torch, transformers) only when asked.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dhp.errors import ConfigError, ConfigIssue

if TYPE_CHECKING:
    from dhp.models.arch import FamilyArch
    from dhp.models.family import ModelFamily

_HERE = Path(__file__).resolve().parent
#: a flavour's name -> the family folder that holds it (the family is then held to that flavour)
ALIASES = {"qwen3_vl_moe": "qwen3_vl", "qwen3_5_moe": "qwen3_5"}
_EXTRA: dict[str, Callable[[], Any]] = {}  # families registered by hand (tests)
_EXTRA_ARCH: dict[str, FamilyArch] = {}


def register_family(name: str, factory: Callable[[], ModelFamily], arch: FamilyArch | None = None) -> None:
    """Make ``get_family(name)`` return ``factory()`` (a family that is not a folder here) and, when
    given, ``get_arch(name)`` return ``arch`` (so the planner can plan it)."""
    _EXTRA[name] = factory
    if arch is not None:
        _EXTRA_ARCH[name] = arch


def unregister_family(name: str) -> None:
    """Forget a family registered by hand."""
    _EXTRA.pop(name, None)
    _EXTRA_ARCH.pop(name, None)


def family_names() -> list[str]:
    """Every family name: the folders of ``dhp/models`` that have a ``family.py``, the flavours'
    aliases of them, and hand-registered ones."""
    found = {p.parent.name for p in _HERE.glob("*/family.py")}
    return sorted(found | set(ALIASES) | set(_EXTRA))


def family_package(name: str) -> str:
    """The package of family ``name`` (an alias: its folder's), e.g. ``dhp.models.qwen3_vl``: where its
    ``family`` and ``modules`` (transformers' model code) are, for a process that preloads them."""
    return f"dhp.models.{ALIASES.get(name, name)}"


def _unknown(name: str) -> ConfigError:
    return ConfigError(
        [
            ConfigIssue(
                path="model.family",
                value=name,
                rule=f"unknown model family; known: {', '.join(family_names())}",
                fix="set model.family to one of the known families",
            )
        ]
    )


def get_family(name: str) -> ModelFamily:
    """The family ``name`` (``dhp.models.<name>.family.FAMILY()``; an alias: ``FAMILY(name)`` of its
    folder, held to that flavour); ConfigError listing the known ones."""
    if name in _EXTRA:
        return _EXTRA[name]()
    if name not in family_names():
        raise _unknown(name)
    family = importlib.import_module(f"{family_package(name)}.family").FAMILY
    return family(name) if name in ALIASES else family()


def get_arch(name: str) -> FamilyArch:
    """The family's pure architecture object (``dhp.models.<name>.arch.ARCH``, an alias's folder's, or
    the one registered with it), no torch imported. The flavour an alias names is checked by the
    architecture's own validation, which reads ``model.family``."""
    if name in _EXTRA_ARCH:
        return _EXTRA_ARCH[name]
    if name not in family_names() or name in _EXTRA:
        raise _unknown(name)
    return importlib.import_module(f"{family_package(name)}.arch").ARCH
