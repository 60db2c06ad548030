"""Qwen2.5-VL's parallel plans by FQN: what ``dhp.parallel`` shards in each module, and where SP attends.

Encoder: the shared Qwen2.5-VL-style encoder's plan with its fused ``qkv``
(``dhp/models/qwen2_5_vision/tp.py``: TP by FQN, Ulysses SP only on the full-attention blocks). LLM: the
usual decoder plan under ``language_model`` + ``lm_head``.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLTextConfig

from dhp.models.axes import runtime_plan
from dhp.models.family import ModuleParallelPlan
from dhp.models.qwen2_5_vision.tp import vision_parallel_plan
from dhp.models.qwen2_5_vision.tp import vision_tp_plan as vision_tp_plan  # re-exported (fused qkv)
from dhp.models.qwen2_5_vl.arch import llm_axes
from dhp.parallel.llm_tp import decoder_tp_plan


def llm_tp_plan(*, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The LLM TP plan (``language_model`` decoder + ``lm_head``), with SP inside TP when asked."""
    return decoder_tp_plan(model="language_model", lm_head="lm_head", sequence_parallel=sequence_parallel)


def parallel_plan(
    name: str, hf_config: Qwen2_5_VLConfig | Qwen2_5_VLTextConfig, *, tied: dict[str, str]
) -> ModuleParallelPlan:
    """Encoder: TP by FQN, SP on the full-attention blocks. LLM: decoder TP (+ SP inside TP), the loss.
    What each degree must divide is the declared axes' (``vision_axes`` / ``arch.llm_axes``)."""
    if name == "vision":
        return vision_parallel_plan(hf_config.vision_config, fused_qkv=True)
    t = hf_config.text_config if isinstance(hf_config, Qwen2_5_VLConfig) else hf_config
    axes = llm_axes(
        heads=t.num_attention_heads,
        kv_heads=t.num_key_value_heads,
        vocab=t.vocab_size,
        mlp=t.intermediate_size,
        layers=t.num_hidden_layers,
        tied=bool(tied),  # the family's tied parameters (lm_head -> embed_tokens)
    )
    return runtime_plan(
        axes,
        blocks=("language_model.layers.*",),
        tp=lambda sequence_parallel: llm_tp_plan(sequence_parallel=sequence_parallel),
        loss=True,
        tied=tied,
        pad_token_id=t.pad_token_id,
    )
