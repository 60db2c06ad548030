"""Qwen3-VL tensor-parallel plans: module FQN glob -> DTensor style (one FQN atom per ``*``).

Encoder: the shared Qwen3 vision plan with the DeepStack mergers (``dhp/models/qwen3_vision/tp.py``).

LLM: Qwen3's decoder has the same projection FQNs as the generic decoder plan (q/k/v colwise, o rowwise,
gate/up colwise, down rowwise, vocab-parallel embeddings and lm_head). q_norm / k_norm (RMSNorm over
head_dim, one weight shared by all heads) run on this rank's heads only, so their weight gradient is a
partial sum per rank: they get ``SequenceParallel(sequence_dim=2)``, i.e. a replicated DTensor weight
applied to the (B, S, heads, head_dim) input marked as sharded on the heads dim, and DTensor sums the
weight gradient over the TP group (without it the q/k norm grads are 1/tp-partial). Megatron sequence parallelism inside TP is NOT declared: transformers adds
each DeepStack feature to the hidden states at the image-token positions by boolean indexing between
decoder layers, which needs the whole sequence on every rank (replicated hidden states between layers).
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from dhp.models.qwen3_vision.tp import vision_tp_plan as _shared_vision_tp_plan
from dhp.parallel.llm_tp import decoder_tp_plan


def vision_tp_plan() -> dict[str, ParallelStyle]:
    """Every ``nn.Linear`` of the encoder (DeepStack mergers included) matches exactly one glob (tested)."""
    return _shared_vision_tp_plan(deepstack=True)


def llm_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The decoder plan without sequence parallelism, plus the per-head norms (see the module docstring)."""
    plan = decoder_tp_plan(model="language_model", lm_head="lm_head", sequence_parallel=False)
    for norm in ("q_norm", "k_norm"):
        plan[f"language_model.layers.*.self_attn.{norm}"] = SequenceParallel(
            sequence_dim=2, use_local_output=True
        )
    return plan
