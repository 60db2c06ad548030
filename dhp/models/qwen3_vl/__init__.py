"""Qwen3-VL (DeepStack) as a module graph: ``vision`` -> ``image_embeds`` + ``deepstack_embeds_k`` -> ``llm``.

Importing this package loads nothing heavy (the planner reads ``arch.py`` without torch); the names
below are imported on first use. The family is found by its folder (``dhp.models.registry``).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Qwen3VLFamily": "dhp.models.qwen3_vl.family",
    "LLMModule": "dhp.models.qwen3_vl.modules",
    "VisionModule": "dhp.models.qwen3_vision.modules",
    "deepstack_kwarg": "dhp.models.qwen3_vision.arch",
    "mrope_positions": "dhp.models.qwen3_vl.modules",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
