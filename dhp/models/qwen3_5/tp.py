"""Qwen3.5 LLM tensor-parallel plan: module FQN glob -> DTensor style (one FQN atom per ``*``).

Encoder: the shared Qwen3 vision plan without DeepStack mergers (``dhp/models/qwen3_vision/tp.py``).

LLM, composed from the generic pieces of ``dhp.parallel``:

- gated full-attention layers (``self_attn``, the decoder plan of ``dhp.parallel.llm_tp``): q_proj
  column-parallel (transformers lays its output out per head as ``[query_h | gate_h]``, so a contiguous
  column shard gives each rank whole heads with their gates), k/v column-parallel, o row-parallel;
  q_norm / k_norm (one weight shared by the heads) as ``SequenceParallel(sequence_dim=2)`` so DTensor
  sums their weight gradient over TP;
- Gated DeltaNet layers (``linear_attn``, ``dhp.parallel.linear_attn_tp``): key/value heads split over
  the TP ranks (in_proj_qkv and the conv1d by head group of q, k and v; in_proj_z/b/a, A_log, dt_bias by
  value head; out_proj row-parallel; the gated RMSNorm on the local heads, its shared weight's gradient
  summed over TP): each rank holds 1/tp of every DeltaNet parameter but the dv-sized norm weight;
- every layer's SwiGLU MLP gate/up column-, down row-parallel; vocab-parallel embeddings and lm_head.

With ``sequence_parallel`` (Megatron SP inside TP) the norms and residual stream are sequence shards
between layers; each attention / DeltaNet / MLP gathers the sequence (the DeltaNet recurrence needs every
position of a sequence) and reduce-scatters its output. Qwen3.5 has no DeepStack, so nothing between
layers needs the whole sequence.

MoE flavour: the shared expert is a dense SwiGLU, so it is TP-sharded like the dense MLP (gate/up
column-, down row-parallel: its output is all-reduced); its sigmoid gate (H -> 1), the router and the
routed experts are not TP-sharded: after the all-reduces the hidden states are whole on every TP rank,
each TP rank routes the same tokens and runs the same experts (all, or its ``E/ep`` under expert
parallelism, ``dhp.parallel.ep``), so their gradients are equal on every TP rank. No Megatron sequence
parallelism inside TP for it: the routed experts' output covers the whole sequence and would have to be
added to a sequence-sharded shared-expert output.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle

from dhp.models.qwen3_base.tp import qwen3_decoder_tp_plan
from dhp.parallel.linear_attn_tp import deltanet_tp_plan


def llm_tp_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The hybrid decoder's plan: the Qwen3 decoder's (``qwen3_base.tp``), whose ``self_attn`` / ``mlp``
    globs match the layers that have them, plus the Gated DeltaNet style, which owns every parameter of a
    ``linear_attn`` (its Linears match no glob of their own)."""
    plan = qwen3_decoder_tp_plan(dense_mlp=True, sequence_parallel=sequence_parallel)
    plan.update(deltanet_tp_plan("language_model.layers.*.linear_attn", sequence_parallel=sequence_parallel))
    return plan


def moe_llm_tp_plan() -> dict[str, ParallelStyle]:
    """The MoE flavour's plan (no sequence parallelism): attention and DeltaNet as the dense plan, the
    shared expert's gate/up column-, down row-parallel in place of the dense MLP's globs."""
    plan = llm_tp_plan(sequence_parallel=False)
    mlp = "language_model.layers.*.mlp"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        plan[f"{mlp}.shared_expert.{proj}"] = plan.pop(f"{mlp}.{proj}")
    return plan
