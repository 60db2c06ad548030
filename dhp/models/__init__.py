"""Model families as module graphs (see ``family.py``); no parallelism code lives here."""

from dhp.models.family import HandOff, LLMOutput, ModelFamily, family_names, get_family, register_family
from dhp.models.qwen2_5_vl import LLMModule, Qwen25VLFamily, VisionModule

register_family(Qwen25VLFamily.name, Qwen25VLFamily)

__all__ = [
    "HandOff",
    "LLMModule",
    "LLMOutput",
    "ModelFamily",
    "Qwen25VLFamily",
    "VisionModule",
    "family_names",
    "get_family",
    "register_family",
]
