"""Qwen3-VL-MoE's LLM tensor-parallel plan: module FQN glob -> DTensor style (one FQN atom per ``*``).

The encoder's plan is the shared Qwen3 vision plan with the DeepStack mergers
(``dhp/models/qwen3_vision/tp.py``).

LLM: attention as Qwen3-VL's (q/k/v colwise, o rowwise; q_norm / k_norm as ``SequenceParallel`` on the
heads dim so their shared weight's gradient is summed over TP), vocab-parallel embeddings and lm_head;
the dense layers' SwiGLU (``mlp_only_layers``) gate/up colwise, down rowwise. The sparse layers' router
(``mlp.gate``) and experts (``mlp.experts``) are NOT TP-sharded: after o_proj's all-reduce the hidden
states are whole on every TP rank, each TP rank routes the same tokens and runs the same experts
(whole, or its ``E/ep`` of them under expert parallelism, ``dhp.parallel.ep``), so their gradients are
equal on every TP rank and need no TP reduction. No Megatron sequence parallelism inside TP: DeepStack
adds features between decoder layers by boolean indexing, which needs the whole sequence.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from dhp.parallel.llm_tp import decoder_tp_plan

#: the dense-MLP projections of the generic decoder plan (absent from a sparse layer)
_DENSE_MLP = ("gate_proj", "up_proj", "down_proj")


def llm_plan(*, dense_mlp: bool) -> dict[str, ParallelStyle]:
    """The decoder plan without sequence parallelism, plus the per-head norms; the dense MLP's globs only
    when some layer is dense (``dense_mlp``), so every glob matches a module."""
    plan = decoder_tp_plan(model="language_model", lm_head="lm_head", sequence_parallel=False)
    if not dense_mlp:
        for proj in _DENSE_MLP:
            del plan[f"language_model.layers.*.mlp.{proj}"]
    for norm in ("q_norm", "k_norm"):
        plan[f"language_model.layers.*.self_attn.{norm}"] = SequenceParallel(
            sequence_dim=2, use_local_output=True
        )
    return plan
