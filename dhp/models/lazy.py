"""Names a package exports but imports on first use, so importing the package loads nothing heavy.

A family package lists ``{name: module}``; ``import dhp.models.qwen3_vl`` then costs nothing (the planner
reads the family's torch-free ``arch.py``), and ``dhp.models.qwen3_vl.LLMModule`` imports torch and
transformers only when asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, names: Mapping[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """``(__getattr__, __all__)`` for ``package``: ``names`` maps each exported name to its module."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(names[name]), name)

    return __getattr__, sorted(names)
