"""The transformers classes Qwen3-VL's flavours build (this module loads transformers' model code).

Both flavours wrap transformers' own, unmodified classes: the encoder in the shared Qwen3 vision
wrapper (``dhp/models/qwen3_vision/modules.py``, K DeepStack levels), the decoder in the Qwen3 LLM
module (``dhp/models/qwen3_base/llm.py``: DeepStack placement, M-RoPE from ``get_rope_index``, the LM
loss, and the MoE flavour's load-balancing loss).
"""

from __future__ import annotations

from transformers.models.qwen3_vl.modeling_qwen3_vl import (
    Qwen3VLForConditionalGeneration,
    Qwen3VLModel,
    Qwen3VLTextModel,
    Qwen3VLVisionModel,
)
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLMoeModel,
    Qwen3VLMoeTextModel,
    Qwen3VLMoeVisionModel,
)

from dhp.models.qwen3_base.base_family import Classes
from dhp.models.qwen3_base.llm import LLMModule
from dhp.models.qwen3_vision.modules import VisionModule

__all__ = ["CLASSES", "LLMModule", "VisionModule"]

#: moe -> the flavour's classes (``qwen3_vl``, ``qwen3_vl_moe``)
CLASSES = {
    False: Classes(Qwen3VLVisionModel, Qwen3VLTextModel, Qwen3VLModel, Qwen3VLForConditionalGeneration),
    True: Classes(
        Qwen3VLMoeVisionModel, Qwen3VLMoeTextModel, Qwen3VLMoeModel, Qwen3VLMoeForConditionalGeneration
    ),
}
