"""Qwen3.5 (hybrid Gated DeltaNet LLM), dense and MoE, as a module graph: ``vision`` -> ``image_embeds``
-> ``llm``.

Importing this package loads nothing heavy (the planner reads ``arch.py`` without torch); the names
below are imported on first use. The family is found by its folder (``dhp.models.registry``).
"""

from __future__ import annotations

from dhp.models.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "Qwen3_5Family": "dhp.models.qwen3_5.family",
        "LLMModule": "dhp.models.qwen3_base.llm",
        "VisionModule": "dhp.models.qwen3_vision.modules",
    },
)
