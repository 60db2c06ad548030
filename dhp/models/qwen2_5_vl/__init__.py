"""Qwen2.5-VL as a module graph: ``vision`` -> ``image_embeds`` -> ``llm``.

Importing this package loads nothing heavy (the planner reads ``arch.py`` without torch); the names
below are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Qwen25VLFamily": "dhp.models.qwen2_5_vl.family",
    "LLMModule": "dhp.models.qwen2_5_vl.modules",
    "VisionModule": "dhp.models.qwen2_5_vl.modules",
    "mrope_positions": "dhp.models.qwen2_5_vl.modules",
    "Qwen2_5_VLImageTextProcessor": "dhp.models.qwen2_5_vl.processor",
    "load_processor": "dhp.models.qwen2_5_vl.processor",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
