"""What the plan reports about a module's mixture-of-experts and linear-attention blocks (pure).

The memory and time terms themselves live with the others (``memory.py``, ``blocks.py``,
``timing.py``); this collects the figures ``dhp plan`` prints and ``--json`` emits for one rank:

- total and active parameters (:attr:`~dhp.models.arch.ModuleArch.active_params`);
- the routed experts' parameter + gradient + optimizer bytes per rank at every EP degree the module's
  dp x fsdp x cp x sp ranks allow (1/(ep x etp) of the experts; their params and grads replicated over
  edp, their AdamW states partitioned over edp with zero=1; under expert FSDP all three 1/edp of
  that, ``ParallelLayout.expert_param_shards``);
- the dispatch and combine buffers of one micro-batch over all MoE blocks, with a balanced router
  (what the verdict uses) and with a fully unbalanced one (every row of the all-to-all group sent to
  one rank's experts), and the module's peak in that worst case; the load-balancing loss's saved
  router probabilities (kept whatever the AC mode);
- a linear-attention module's recurrent state per sequence and chunk states per rank.
"""

from __future__ import annotations

import dataclasses

from dhp.plan.blocks import delta_rule_states_bytes, dispatch_elems, dispatch_saved_elems
from dhp.plan.memory import ModuleShape, checkpointed_blocks
from dhp.plan.phases import ModuleTerms, gpu_timeline, module_terms

#: which dispatch/combine buffers the fits/OOM verdict counts (see ``dhp/plan/memory.py``)
VERDICT_BUFFERS = "balanced"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_state_bytes(shape: ModuleShape, ep: int) -> int:
    """Parameters + gradients + optimizer states of the routed experts on one rank at ``ep`` and the
    module's other degrees: params and grads 1/``expert_param_shards`` of the experts (ep x etp,
    times edp under expert FSDP), the states 1/edp of 1/(ep x etp) with zero=1 or expert FSDP."""
    pr = shape.precision
    lay = shape.layout.replace(ep=ep)
    if lay.expert_fsdp and lay.edp <= 1:  # one edp rank: nothing to shard over
        lay = lay.replace(expert_fsdp=False)
    per_rank = shape.params.expert / lay.expert_param_shards
    if shape.freeze:
        return int(per_rank * pr.param)
    opt = pr.optimizer / lay.expert_state_split
    return int(per_rank * (pr.param + shape.trainable * (pr.grad + opt)))


def dispatch_bytes(shape: ModuleShape, received: float) -> tuple[int, int]:
    """(one MoE block's, the saved-for-backward total's) dispatch + combine buffers of one micro-batch
    on one rank: a block allocates them while it runs; backward needs the received and combined rows
    of every block that activation checkpointing does not recompute (none under selective AC, which
    recomputes the exchanges: ``dhp/plan/blocks.py``); under expert TP each TP rank's share, 1/etp."""
    arch, etp = shape.arch, shape.layout.etp
    per = [dispatch_elems(b.mlp, hidden=arch.hidden, received=received, etp=etp) for b in arch.blocks]
    kept = 0.0
    if shape.backward and shape.ac.kind != "selective":
        saved = [
            dispatch_saved_elems(b.mlp, hidden=arch.hidden, received=received, etp=etp) for b in arch.blocks
        ]
        kept = sum(saved) * (1 - checkpointed_blocks(shape.ac, arch.layers) / arch.layers)
    a = shape.precision.act
    return int(shape.tokens * max(per) * a), int(shape.tokens * kept * a)


def moe_summary(shape: ModuleShape, terms: ModuleTerms, *, micro_batches: int, optimizer_impl: str) -> dict:
    """The MoE figures of one rank (module docstring); empty for a module without MoE blocks."""
    arch = shape.arch
    if arch is None or not arch.moe_blocks:
        return {}
    par = shape.layout
    ep, folded, group = par.ep, par.token_ranks, par.expert_group
    worst_shape = dataclasses.replace(shape, moe_received=float(group))  # the group's rows to one rank
    worst = module_terms(worst_shape, micro_batches=micro_batches, optimizer_impl=optimizer_impl)
    # the expert axes' keys only where one is on: a plan without them reads as it always did
    axes = (
        {"etp": par.etp, "expert_fsdp": par.expert_fsdp, "expert_param_shards": par.expert_param_shards}
        if par.etp > 1 or par.expert_fsdp
        else {}
    )
    return {
        "ep": ep,
        "edp": par.edp,
        **axes,
        "experts": arch.experts,
        "experts_per_rank": arch.experts // group,
        "moe_blocks": arch.moe_blocks,
        "expert_params_per_rank": int(shape.params.expert / par.expert_param_shards),
        "expert_optimizer_shards": par.expert_optimizer_shards,
        "expert_state_bytes": expert_state_bytes(shape, ep),
        "expert_state_bytes_by_ep": {str(e): expert_state_bytes(shape, e) for e in _divisors(folded)},
        "dispatch_combine_block_bytes": dispatch_bytes(shape, 1.0)[0],
        "dispatch_combine_saved_bytes": dispatch_bytes(shape, 1.0)[1],
        "dispatch_combine_worst_block_bytes": dispatch_bytes(shape, float(group))[0],
        "dispatch_combine_worst_saved_bytes": dispatch_bytes(shape, float(group))[1],
        "verdict_uses": VERDICT_BUFFERS,
        "peak_bytes": gpu_timeline([terms]).peak,
        "worst_case_peak_bytes": gpu_timeline([worst]).peak,
        "worst_terms": worst,
    }


def linear_summary(shape: ModuleShape) -> dict:
    """A linear-attention module's recurrent state per sequence (all heads, fp32) and the chunk
    states of its largest linear block on one rank (heads split by TP); empty without one."""
    arch = shape.arch
    linear = [b.attention for b in arch.blocks if b.attention.kind == "linear"] if arch else []
    if not linear:
        return {}
    att = max(linear, key=lambda a: a.state_elems())
    tp = shape.layout.tp
    return {
        "linear_blocks": len(linear),
        "full_blocks": arch.layers - len(linear),
        "state_bytes_per_sequence": int(att.state_elems() / tp * 4),
        "chunk": att.chunk_len,
        "chunk_states_bytes": delta_rule_states_bytes(
            att, seqs=shape.micro_batch, seq_len=shape.seq_len, tp=tp, act=shape.precision.act
        ),
        "delta_rule_tflops_per_token": arch.delta_rule_flops() / 1e12,
    }
