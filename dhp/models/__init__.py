"""Model families as module graphs (see ``family.py``, ``registry.py``); no parallelism code lives here.

Importing ``dhp.models`` loads nothing heavy: ``registry`` and each family's ``arch.py`` are
torch-free (the planner uses them); the names below are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from dhp.models.registry import family_names, get_arch, get_family, register_family

_LAZY = {
    "HandOff": "dhp.models.family",
    "LLMOutput": "dhp.models.family",
    "ModelFamily": "dhp.models.family",
    "TINY_TOKENS": "dhp.models.qwen2_5_vl.family",
    "Qwen25VLFamily": "dhp.models.qwen2_5_vl.family",
    "LLMModule": "dhp.models.qwen2_5_vl.modules",
    "VisionModule": "dhp.models.qwen2_5_vl.modules",
    "LoadReport": "dhp.models.loading",
    "build_and_load": "dhp.models.loading",
    "checkpoint_index": "dhp.models.loading",
    "load_module_weights": "dhp.models.loading",
    "Qwen2_5_VLImageTextProcessor": "dhp.models.qwen2_5_vl.processor",
    "load_processor": "dhp.models.qwen2_5_vl.processor",
    "make_tiny_checkpoint": "dhp.models.tiny",
}

__all__ = ["family_names", "get_arch", "get_family", "register_family", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
