"""Model families as module graphs (see ``family.py``); no parallelism code lives here."""

from dhp.models.family import HandOff, LLMOutput, ModelFamily, family_names, get_family, register_family
from dhp.models.qwen2_5_vl import TINY_TOKENS, LLMModule, Qwen25VLFamily, VisionModule

register_family(Qwen25VLFamily.name, Qwen25VLFamily)

from dhp.models.loading import LoadReport, build_and_load, checkpoint_index, load_module_weights  # noqa: E402
from dhp.models.qwen2_5_vl.processor import Qwen2_5_VLImageTextProcessor, load_processor  # noqa: E402
from dhp.models.tiny import make_tiny_checkpoint  # noqa: E402

__all__ = [
    "TINY_TOKENS",
    "HandOff",
    "LLMModule",
    "LLMOutput",
    "LoadReport",
    "ModelFamily",
    "Qwen2_5_VLImageTextProcessor",
    "Qwen25VLFamily",
    "VisionModule",
    "build_and_load",
    "checkpoint_index",
    "family_names",
    "get_family",
    "load_module_weights",
    "load_processor",
    "make_tiny_checkpoint",
    "register_family",
]
