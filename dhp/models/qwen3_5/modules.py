"""The transformers classes Qwen3.5's flavours build (this module loads transformers' model code).

Both flavours wrap transformers' own, unmodified classes: the encoder in the shared Qwen3 vision
wrapper with K = 0 (``dhp/models/qwen3_vision/modules.py``), the hybrid decoder (Gated DeltaNet and
gated full-attention layers by ``layer_types``; on CPU the DeltaNet layers run transformers' torch
chunked gated-delta-rule fallback) in the Qwen3 LLM module (``dhp/models/qwen3_base/llm.py``: M-RoPE
from ``get_rope_index``, the LM loss, and the MoE flavour's load-balancing loss).
"""

from __future__ import annotations

from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5ForConditionalGeneration,
    Qwen3_5Model,
    Qwen3_5TextModel,
    Qwen3_5VisionModel,
)
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeModel,
    Qwen3_5MoeTextModel,
    Qwen3_5MoeVisionModel,
)

from dhp.models.qwen3_base.base_family import Classes
from dhp.models.qwen3_base.llm import LLMModule
from dhp.models.qwen3_vision.modules import VisionModule

__all__ = ["CLASSES", "LLMModule", "VisionModule"]

#: moe -> the flavour's classes (``qwen3_5``, ``qwen3_5_moe``)
CLASSES = {
    False: Classes(Qwen3_5VisionModel, Qwen3_5TextModel, Qwen3_5Model, Qwen3_5ForConditionalGeneration),
    True: Classes(
        Qwen3_5MoeVisionModel, Qwen3_5MoeTextModel, Qwen3_5MoeModel, Qwen3_5MoeForConditionalGeneration
    ),
}
