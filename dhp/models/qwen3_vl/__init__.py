"""Qwen3-VL (DeepStack), dense and MoE, as a module graph: ``vision`` -> ``image_embeds`` +
``deepstack_embeds_k`` -> ``llm``.

Importing this package loads nothing heavy (the planner reads ``arch.py`` without torch); the names
below are imported on first use. The family is found by its folder (``dhp.models.registry``); its MoE
flavour also answers to ``qwen3_vl_moe``.
"""

from __future__ import annotations

from dhp.models.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "Qwen3VLFamily": "dhp.models.qwen3_vl.family",
        "LLMModule": "dhp.models.qwen3_base.llm",
        "VisionModule": "dhp.models.qwen3_vision.modules",
        "deepstack_kwarg": "dhp.models.qwen3_vision.arch",
    },
)
