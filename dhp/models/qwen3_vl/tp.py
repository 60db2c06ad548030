"""Qwen3-VL tensor-parallel plans: module FQN glob -> DTensor style (one FQN atom per ``*``).

Encoder: the fused qkv is column-parallel in three chunks (q, k, v each split by heads), proj and the
MLP's linear_fc2 row-parallel; the main merger and every DeepStack merger are column- then row-parallel,
so each merger's output (one edge to the LLM) is whole on every TP rank. The patch embedding, the
learned position table and the LayerNorms stay replicated.

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

from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from dhp.parallel.llm_tp import decoder_tp_plan
from dhp.parallel.vision_tp import FusedColwiseParallel, UnevenRowwiseParallel


def vision_tp_plan() -> dict[str, ParallelStyle]:
    """Every ``nn.Linear`` of the encoder matches exactly one glob (tested)."""
    return {
        "visual.blocks.*.attn.qkv": FusedColwiseParallel(num_chunks=3),
        "visual.blocks.*.attn.proj": RowwiseParallel(),
        "visual.blocks.*.mlp.linear_fc1": ColwiseParallel(),
        "visual.blocks.*.mlp.linear_fc2": UnevenRowwiseParallel(),
        "visual.merger.linear_fc1": ColwiseParallel(),
        "visual.merger.linear_fc2": RowwiseParallel(),
        "visual.deepstack_merger_list.*.linear_fc1": ColwiseParallel(),
        "visual.deepstack_merger_list.*.linear_fc2": RowwiseParallel(),
    }


def llm_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The decoder plan without sequence parallelism, plus the per-head norms (see the module docstring)."""
    plan = decoder_tp_plan(model="language_model", lm_head="lm_head", sequence_parallel=False)
    for norm in ("q_norm", "k_norm"):
        plan[f"language_model.layers.*.self_attn.{norm}"] = SequenceParallel(
            sequence_dim=2, use_local_output=True
        )
    return plan
