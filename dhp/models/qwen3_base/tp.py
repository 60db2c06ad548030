"""The Qwen3 decoder's tensor-parallel plan: module FQN glob -> DTensor style (one FQN atom per ``*``).

The encoder's plan is the shared Qwen3 vision plan (``dhp/models/qwen3_vision/tp.py``).

The decoder has the projection FQNs of the generic decoder plan (q/k/v colwise, o rowwise, gate/up
colwise, down rowwise, vocab-parallel embeddings and lm_head). q_norm / k_norm (RMSNorm over head_dim,
one weight shared by all heads) run on this rank's heads only, so their weight gradient is a partial sum
per rank: they get ``SequenceParallel(sequence_dim=2)``, i.e. a replicated DTensor weight applied to the
(B, S, heads, head_dim) input marked as sharded on the heads dim, and DTensor sums the weight gradient
over the TP group (without it the q/k norm grads are 1/tp-partial).

MoE flavour: the dense layers' SwiGLU (``mlp_only_layers``) is sharded as above; the sparse layers'
router (``mlp.gate``) and experts (``mlp.experts``) are NOT TP-sharded: after o_proj's all-reduce the
hidden states are whole on every TP rank, each TP rank routes the same tokens and runs the same experts
(whole, or its ``E/ep`` of them under expert parallelism, ``dhp.parallel.ep``), so their gradients are
equal on every TP rank and need no TP reduction.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle

from dhp.parallel.linear_attn_tp import head_norm_tp_plan
from dhp.parallel.llm_tp import decoder_tp_plan

#: the dense-MLP projections of the generic decoder plan (absent from a sparse layer)
_DENSE_MLP = ("gate_proj", "up_proj", "down_proj")


def qwen3_decoder_tp_plan(*, dense_mlp: bool, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The decoder plan (Megatron sequence parallelism inside TP when ``sequence_parallel``) plus the
    per-head norms; the dense MLP's globs only when some layer is dense (``dense_mlp``), so every glob
    matches a module."""
    plan = decoder_tp_plan(model="language_model", lm_head="lm_head", sequence_parallel=sequence_parallel)
    if not dense_mlp:
        for proj in _DENSE_MLP:
            del plan[f"language_model.layers.*.mlp.{proj}"]
    plan.update(head_norm_tp_plan("language_model.layers.*.self_attn"))
    return plan
