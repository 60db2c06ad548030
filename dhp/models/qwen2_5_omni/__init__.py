"""Qwen2.5-Omni's thinker as a module graph: ``audio`` -> ``audio_embeds`` and ``vision`` ->
``image_embeds``, both into ``llm``.

Importing this package loads nothing heavy (the planner reads ``arch.py`` without torch); the names
below are imported on first use.
"""

from __future__ import annotations

from dhp.models.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "Qwen25OmniFamily": "dhp.models.qwen2_5_omni.family",
        "AudioModule": "dhp.models.qwen2_5_omni.audio",
        "AudioShard": "dhp.models.qwen2_5_omni.audio",
        "shard_audio": "dhp.models.qwen2_5_omni.audio",
        "LLMModule": "dhp.models.qwen2_5_omni.modules",
        "VisionModule": "dhp.models.qwen2_5_vision.modules",
        "tmrope_positions": "dhp.models.qwen2_5_omni.modules",
    },
)
