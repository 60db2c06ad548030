"""Qwen3.5 LLM tensor-parallel plan: module FQN glob -> DTensor style (one FQN atom per ``*``).

Encoder: the shared Qwen3 vision plan without DeepStack mergers (``dhp/models/qwen3_vision/tp.py``).

LLM, gated full-attention layers: q_proj column-parallel (transformers lays its output out per head as
``[query_h | gate_h]``, so a contiguous column shard gives each rank whole heads with their gates), k/v
column-parallel, o row-parallel; q_norm / k_norm (one weight shared by the heads) as
``SequenceParallel(sequence_dim=2)`` so DTensor sums their weight gradient over TP. Every layer's
SwiGLU MLP gate/up column-, down row-parallel; vocab-parallel embeddings and lm_head. No Megatron
sequence parallelism inside TP. The Gated DeltaNet layers' styles (``linear_attn.*``) are not in this
plan: the family gives tp=None (``family.parallel_plan``) until they shard by head group.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from dhp.parallel.llm_tp import decoder_tp_plan


def attention_tp_plan() -> dict[str, ParallelStyle]:
    """The decoder plan without sequence parallelism plus the per-head norms of the full-attention layers
    (the ``self_attn`` globs match only those layers; ``linear_attn`` is not named here)."""
    plan = decoder_tp_plan(model="language_model", lm_head="lm_head", sequence_parallel=False)
    for norm in ("q_norm", "k_norm"):
        plan[f"language_model.layers.*.self_attn.{norm}"] = SequenceParallel(
            sequence_dim=2, use_local_output=True
        )
    return plan
