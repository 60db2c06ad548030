"""Qwen2.5-VL as a module graph: ``vision`` -> ``image_embeds`` -> ``llm``."""

from dhp.models.qwen2_5_vl.family import TINY_TOKENS, Qwen25VLFamily
from dhp.models.qwen2_5_vl.modules import LLMModule, VisionModule, mrope_positions, shifted_ce_sum

__all__ = ["TINY_TOKENS", "LLMModule", "Qwen25VLFamily", "VisionModule", "mrope_positions", "shifted_ce_sum"]
