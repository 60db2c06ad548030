"""Qwen3-VL (DeepStack) as a module graph: ``vision`` -> ``image_embeds`` + ``deepstack_embeds_k`` -> ``llm``."""

from dhp.models.family import register_family
from dhp.models.qwen3_vl.family import Qwen3VLFamily
from dhp.models.qwen3_vl.modules import LLMModule, VisionModule, deepstack_kwarg, mrope_positions

__all__ = ["LLMModule", "Qwen3VLFamily", "VisionModule", "deepstack_kwarg", "mrope_positions"]

# importing the package registers the family: get_family("qwen3_vl")
register_family(Qwen3VLFamily.name, Qwen3VLFamily)
