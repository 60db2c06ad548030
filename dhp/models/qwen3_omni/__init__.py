"""Qwen3-Omni's thinker as a module graph: ``audio`` -> ``audio_embeds`` and ``vision`` ->
``image_embeds`` + ``deepstack_embeds_k``, all into the MoE ``llm``.

Importing this package loads nothing heavy (the planner reads ``arch.py`` without torch); the names
below are imported on first use. The family is found by its folder (``dhp.models.registry``).
"""

from __future__ import annotations

from dhp.models.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "Qwen3OmniFamily": "dhp.models.qwen3_omni.family",
        "AudioModule": "dhp.models.qwen3_omni.audio",
        "AudioShard": "dhp.models.qwen3_omni.audio",
        "shard_audio": "dhp.models.qwen3_omni.audio",
        "LLMModule": "dhp.models.qwen3_omni.modules",
        "VisionModule": "dhp.models.qwen3_vision.modules",
        "tmrope_positions": "dhp.models.qwen3_omni.modules",
    },
)
