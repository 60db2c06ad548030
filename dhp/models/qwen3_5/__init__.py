"""Qwen3.5 (dense) as a module graph: ``vision`` -> ``image_embeds`` -> hybrid ``llm``.

Importing this package loads nothing heavy (the planner reads ``arch.py`` without torch); the names
below are imported on first use. The family is found by its folder (``dhp.models.registry``).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Qwen3_5Family": "dhp.models.qwen3_5.family",
    "LLMModule": "dhp.models.qwen3_5.modules",
    "VisionModule": "dhp.models.qwen3_vision.modules",
    "mrope_positions": "dhp.models.qwen3_5.modules",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
