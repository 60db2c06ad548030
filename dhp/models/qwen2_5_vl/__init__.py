"""Qwen2.5-VL as a module graph: ``vision`` -> ``image_embeds`` -> ``llm``.

Importing this package loads nothing heavy (the planner reads ``arch.py`` without torch); the names
below are imported on first use.
"""

from __future__ import annotations

from dhp.models.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "Qwen25VLFamily": "dhp.models.qwen2_5_vl.family",
        "LLMModule": "dhp.models.qwen2_5_vl.modules",
        "VisionModule": "dhp.models.qwen2_5_vl.modules",
        "mrope_positions": "dhp.models.qwen2_5_vl.modules",
        "Qwen2_5_VLImageTextProcessor": "dhp.models.qwen2_5_vl.processor",
        "load_processor": "dhp.models.qwen2_5_vl.processor",
    },
)
