"""Optimizer construction and the gradient pipeline one module runs after backward.

Order per step on every rank of a module group (all collectives over the group's own world)::

    finalize_grads(module, mesh, layout)            # SUM over sp, then over dp (FSDP already reduced);
                                                    # expert-parallel params: SUM over edp only
    sq = grad_norm_sq(module, mesh)                 # full-module ||g||^2, same value on every rank
    clip_grads_(module, coef)                       # coef from the driver (norm over all modules)
    optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dhp.config.constants import OPTIMIZER_IMPLS
from dhp.config.schema import ParamGroupConfig, TrainConfig
from dhp.errors import PlanError
from dhp.layout import ZERO1_AXES, ParallelLayout
from dhp.parallel.dp import Zero1AdamW, allreduce_grads_, local
from dhp.parallel.ep import expert_fold_mesh, expert_params, reduce_expert_grads_
from dhp.parallel.meshutil import axes, axis, axis_size, group_world
from dhp.parallel.param_groups import optimizer_groups


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _split_experts(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(trainable non-expert parameters, trainable expert-parallel parameters) of ``module``."""
    experts = {id(p) for _, p in expert_params(module)}
    trainable = _trainable(module)
    return [p for p in trainable if id(p) not in experts], [p for p in trainable if id(p) in experts]


def build_optimizer(
    module: nn.Module,
    mesh: DeviceMesh,
    layout: ParallelLayout,
    *,
    train: TrainConfig,
    param_groups: Sequence[ParamGroupConfig] = (),
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (DTensor shards stay shards); ZeRO-1 when ``zero=1``.

    ZeRO-1 shards the optimizer over every rank that holds the same parameters after
    ``finalize_grads``: the ``dp`` and ``sp`` axes (SP ranks replicate the encoder's weights and hold
    identical summed grads), flattened into one group. TP/FSDP shards are already distinct per rank.
    ``train.optimizer.impl`` picks torch's implementation (:func:`impl_kwargs`); ZeRO-1 runs the same
    one over its owned parameters. Transients of the step: none with ``fused``, one temporary of every
    owned element with ``foreach`` (``sqrt(v)``), up to three of the largest parameter with ``for_loop``.
    Memory: 2 states per local parameter element, in the parameter's dtype (torch's AdamW allocates
    them like the parameter: bf16 states for a ``model.dtype=bfloat16`` module, fp32 for fp32; the
    planner's ``dhp.plan.memory.precision`` counts the same); with ZeRO-1 only for the ~1/(dp*sp)
    owned here (``dhp.layout.ZERO1_AXES``, the planner's too). Expert-parallel parameters
    (:func:`dhp.parallel.ep.expert_params`) are not partitioned over dp x sp (its ranks hold DIFFERENT
    experts) but over the ``edp`` axis of their EP mesh (the ranks holding the SAME 1/ep of the
    experts, whose grads ``finalize_grads`` summed): each rank keeps the states of ~1/(ep * edp) of
    the experts (per-tensor granularity) and broadcasts the ones it owns over edp after the step.

    ``param_groups``: per-glob lr/weight_decay (``dhp.parallel.param_groups.optimizer_groups``); the
    optimizer's groups are the default one first, then these, in the same order on every rank. Only
    parameters with ``requires_grad`` enter (frozen ones get no state); set the LR with :func:`set_lr`.
    """
    if layout.zero not in (0, 1):
        raise PlanError(
            f"parallel.zero={layout.zero}: only 0 (plain DP) and 1 (ZeRO-1) exist. Fix: use fsdp for ZeRO-3."
        )
    adamw = {
        "lr": train.lr,
        "betas": tuple(train.betas),
        "weight_decay": train.weight_decay,
        **impl_kwargs(train.optimizer.impl),
    }
    params = _split_expert_groups(optimizer_groups(module, param_groups=param_groups, train=train), module)
    if train.optimizer.impl != "for_loop":
        params = _split_dtensor_groups(params)
    group = _zero1_group(mesh) if layout.zero == 1 else None
    if group is not None:
        experts = [p for _, p in expert_params(module)]
        fold = expert_fold_mesh(module)
        # under expert FSDP the experts' states are already 1/edp per rank (their FSDP shards)
        partition = fold is not None and fold["edp"].size() > 1 and not layout.expert_fsdp
        edp = fold["edp"].get_group() if partition else None
        return Zero1AdamW(params, dp_group=group, unpartitioned=experts, expert_group=edp, **adamw)
    return torch.optim.AdamW(params, **adamw)


def _moe_expert_ids(module: nn.Module) -> set[int]:
    """ids of the experts' parameters of the MoE blocks the family declares (``plan.moe_blocks``),
    whether EP swapped them or not (a module without a plan or MoE blocks: none)."""
    plan = getattr(module, "parallel_plan", None)
    glob = plan.moe_blocks if plan is not None else ""
    if not glob:
        return set()
    return {
        id(p)
        for fqn, sub in module.named_modules()
        if fnmatch.fnmatchcase(fqn, glob) and hasattr(sub, "experts")
        for p in sub.experts.parameters()
    }


def _split_expert_groups(groups: list[dict], module: nn.Module) -> list[dict]:
    """Each group holding MoE experts' parameters and others becomes two (others first, then the
    experts) with the same settings, at EVERY ep degree: the optimizer's groups, which a DCP
    checkpoint stores by index, are then the same at ep=1 and ep=N, so a run resumes across ep."""
    experts = _moe_expert_ids(module)
    if not experts:
        return groups
    out = []
    for g in groups:
        rest = [p for p in g["params"] if id(p) not in experts]
        mine = [p for p in g["params"] if id(p) in experts]
        out += [{**g, "params": rest}, {**g, "params": mine}] if rest and mine else [g]
    return out


def _split_dtensor_groups(groups: list[dict]) -> list[dict]:
    """Each group holding both DTensor and plain parameters (a TP module's sharded projections beside
    its replicated norms) becomes two with the same settings: fused and foreach AdamW take one list
    per group, and DTensor refuses a list mixing the two. The split depends only on the module's
    structure, so every rank (ZeRO-1 owners included) gets the same groups in the same order.
    (Expert-parallel DTensors, on their own ``ep`` mesh, are already a group of their own:
    :func:`_split_expert_groups`.)"""
    out = []
    for g in groups:
        dt = [p for p in g["params"] if isinstance(p, DTensor)]
        plain = [p for p in g["params"] if not isinstance(p, DTensor)]
        out += [{**g, "params": dt}, {**g, "params": plain}] if dt and plain else [g]
    return out


def impl_kwargs(impl: str) -> dict[str, bool]:
    """torch.optim.AdamW's keyword arguments selecting ``impl`` (``OPTIMIZER_IMPLS``)."""
    if impl == "fused":
        return {"fused": True}
    if impl == "foreach":
        return {"foreach": True}
    if impl == "for_loop":
        return {"foreach": False}
    raise PlanError(f"train.optimizer.impl={impl!r}: unknown. Fix: use one of {', '.join(OPTIMIZER_IMPLS)}.")


def _zero1_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The process group ZeRO-1 shards over: the present ``ZERO1_AXES``, flattened; None if degree 1."""
    sub = axes(mesh, ZERO1_AXES)
    if sub is None:
        return None
    if sub.ndim > 1:
        sub = sub._flatten("zero1")
    return sub.get_group()


def finalize_grads(module: nn.Module, mesh: DeviceMesh, layout: ParallelLayout) -> None:
    """Every cross-rank gradient reduction of one step, in place: SUM over ``sp`` then over ``dp``.

    TP needs none (DTensor grads are complete per shard), except that with sequence parallelism inside
    TP the replicated norm weights collect ``Partial`` (per-sequence-shard) grads: DTensor reduces them
    to their parameter's placement here. FSDP2 reduced (and, with dp, all-reduced) in backward. The
    result on every rank: the gradient of sum_r(loss_sum_r / T) for its placement.

    Expert-parallel parameters (``dhp.parallel.ep``) are excluded from the sp/dp sums (the ranks of an
    EP group hold different experts; FSDP ignores them) and SUMMED over ``edp`` instead: the all-to-all
    backward already brought every token of the EP group to its expert's rank. Under expert FSDP
    their own FSDP2 units reduce-scattered them over ``edp`` in backward: nothing is left to do.
    """
    _reduce_partial_grads_(module)
    dense, experts = _split_experts(module)
    for name in ("cp", "sp"):  # each CP / SP rank holds the partial gradient of its own tokens
        part = axis(mesh, name)
        if part is not None:
            allreduce_grads_(dense, part.get_group())
    dp = axis(mesh, "dp")
    if dp is not None and layout.fsdp == 1:
        allreduce_grads_(dense, dp.get_group())
    fold = expert_fold_mesh(module)
    if experts and fold is not None and not layout.expert_fsdp:  # expert FSDP reduce-scattered them
        reduce_expert_grads_(experts, fold)


@torch.no_grad()
def _reduce_partial_grads_(module: nn.Module) -> None:
    """DTensor grads with a ``Partial`` placement (SP-in-TP norms) -> their parameter's placements."""
    for p in module.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)


def _shard_fraction(t: torch.Tensor, world: int) -> float:
    """1 / (number of ranks holding an identical copy of this rank's piece of ``t``)."""
    if not isinstance(t, DTensor):
        return 1.0 / world
    distinct = 1
    for dim, p in enumerate(t.placements):
        if p.is_partial():
            raise PlanError("grad_norm_sq on a Partial gradient: call finalize_grads first.")
        if not p.is_replicate():  # Shard, _StridedShard (FSDP over TP), ...: each rank holds other elements
            distinct *= t.device_mesh.size(dim)
    return distinct / world


def grad_norm_sq(module: nn.Module, mesh: DeviceMesh) -> float:
    """Squared L2 norm of the FULL module's gradient, identical on every rank (one all-reduce).

    Each logical element counts once: a rank adds its local ||g||^2 weighted by 1/(copies of that
    piece in its pipeline stage's ranks) (TP/FSDP shards, params replicated over dp/sp/tp), in float64;
    the stages hold different layers, so the all-reduce over the world sums them.
    """
    world = dist.get_world_size(group_world(mesh)) // axis_size(mesh, "pp")
    total = torch.zeros((), dtype=torch.float64)
    for p in module.parameters():
        if p.grad is None:
            continue
        g = local(p.grad)
        total += g.detach().double().pow(2).sum().cpu() * _shard_fraction(p.grad, world)
    device = mesh.device_type
    total = total.to(device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return float(total.item())


@torch.no_grad()
def clip_grads_(module: nn.Module, coef: float) -> None:
    """Multiply every gradient (DTensor: its local shard) by ``coef`` in place; the driver computes ``coef``."""
    for p in module.parameters():
        if p.grad is not None:
            p.grad.mul_(coef)
