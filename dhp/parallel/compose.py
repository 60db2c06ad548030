"""``parallelize``: apply a module's strategies in a fixed order from data, with no strategy if/elif chains.

Order (torchtitan's): PP (this rank keeps only its pipeline stages' decoder layers, :mod:`dhp.parallel.
pipeline`, so every later strategy shards only what the stage holds) -> EP (the MoE blocks' experts swapped for expert-parallel ones on the folded mesh,
:mod:`dhp.parallel.ep`) -> TP (with sequence parallelism inside TP when configured) -> the LLM's loss
(chunked; the single-process one when there is no TP) -> Ulysses SP -> the bf16 compute cast of fp32
master weights without FSDP (:mod:`dhp.parallel.precision`; before AC, so a checkpointed block casts
again in its recompute) -> activation checkpointing -> FSDP2 (whose mixed-precision policy is the same
cast when fsdp > 1). EP is a generic step like the others, not the family's: the family only declares its MoE
blocks as data (``plan.moe_blocks``, ``plan.experts``; a module with MoE blocks also gets its
``aux_loss_group``, the ranks of different tokens); EP comes first because it replaces modules
(TP and FSDP must see the expert DTensors, which they leave alone: TP's styles do not match them and
FSDP ignores them, so expert weights stay sharded over ``ep`` and replicated over ``edp``). TP and SP change what a rank computes; AC wraps the (already parallel) layers; FSDP shards whatever parameters are left last,
so it sees TP DTensors as 2-D. DP needs nothing at this point: its gradient SUM is
:func:`dhp.parallel.optim.finalize_grads` and ZeRO-1 is :func:`dhp.parallel.optim.build_optimizer`.

What each module supports is data its family attached at build (``module.parallel_plan``, a
:class:`~dhp.parallel.module_plan.ModuleParallelPlan`: TP styles by FQN, attention sites for SP, FSDP blocks,
whether it has a loss); what each strategy does is one ``apply_<x>(module, mesh, spec)``; the table
:data:`STEPS` says when a strategy is on. Nothing here names a model family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dhp.config.ac import parse_ac_mode
from dhp.config.plan_space import ModuleAxes, module_problems
from dhp.errors import PlanError
from dhp.layout import TOKEN_AXES, ParallelLayout
from dhp.parallel.ac import AcSpec, apply_ac
from dhp.parallel.cp import apply_cp
from dhp.parallel.ep import apply_ep, ep_mesh
from dhp.parallel.fsdp import FsdpSpec, apply_expert_fsdp, apply_fsdp, fsdp_blocks
from dhp.parallel.linear_attn_cp import apply_deltanet_cp
from dhp.parallel.llm_tp import apply_tp, local_loss_sum
from dhp.parallel.meshutil import AXES, axes, axis, axis_size
from dhp.parallel.module_plan import ModuleParallelPlan
from dhp.parallel.pipeline import apply_pp
from dhp.parallel.plan_match import matching
from dhp.parallel.precision import apply_compute_cast, check_parameter_dtypes, precision_of
from dhp.parallel.ulysses import UlyssesSpec, apply_ulysses_sp, module_plan


@dataclass(frozen=True)
class _Ctx:
    name: str
    plan: ModuleParallelPlan
    layout: ParallelLayout
    activation_checkpointing: str  # a dhp.config.ac mode (bools accepted)
    mixed_precision: str
    loss_chunk_tokens: int  # 0 = dhp.ops.DEFAULT_LOSS_CHUNK_TOKENS


def _tp(module: nn.Module, mesh: DeviceMesh, ctx: _Ctx) -> nn.Module:
    return apply_tp(
        module,
        mesh,
        sequence_parallel=ctx.layout.sequence_parallel,
        loss_chunk_tokens=ctx.loss_chunk_tokens,
        module_name=ctx.name,
    )


def _loss(module: nn.Module, ctx: _Ctx) -> nn.Module:
    """Without TP: the chunked single-process loss with the configured chunk size."""
    module.loss_fn = partial(local_loss_sum, chunk_tokens=ctx.loss_chunk_tokens)
    return module


def _ep(module: nn.Module, mesh: DeviceMesh, ctx: _Ctx) -> nn.Module:
    """Experts of ``plan.moe_blocks`` sharded over ``ep`` ranks folded from dp x fsdp x cp x sp, times
    the TP ranks under expert TP (``etp = tp``: each routes 1/tp of its unit's tokens). A collective:
    builds the (erep, edp, ep) mesh's process groups."""
    tp = axis(mesh, "tp") if ctx.layout.etp > 1 else None
    group = None if tp is None else tp.get_group()
    apply_ep(module, ep_mesh(mesh, ctx.layout), block_glob=ctx.plan.moe_blocks, tp_group=group)
    return module


def _token_group(module: nn.Module, mesh: DeviceMesh, ctx: _Ctx) -> nn.Module:
    """A module with MoE blocks gets ``aux_loss_group``: the ranks holding DIFFERENT tokens of the step
    (dp x fsdp x sp, flattened; never TP duplicates; None on one rank), over which its router's
    load-balancing loss all-reduces the expert counts (``dhp.parallel.load_balancing.load_balancing_loss``), so the
    loss is the global batch's at any ep, dp or fsdp degree. A plain attribute, like ``loss_fn``."""
    sub = axes(mesh, TOKEN_AXES)
    if sub is not None and sub.ndim > 1:
        sub = sub._flatten("tokens")
    module.aux_loss_group = None if sub is None else sub.get_group()
    return module


def _cp(module: nn.Module, mesh: DeviceMesh, ctx: _Ctx) -> nn.Module:
    """Context parallelism over the mesh's ``cp`` axis (``dhp.parallel.cp``): the module's tokens are cut
    into 2 x cp chunks, every micro-batch padded to a multiple of 2 x cp (x tp under SP inside TP); the
    family's linear-attention layers gather their sequence and cut their heads instead
    (``dhp.parallel.linear_attn_cp``), after TP's heads cut (applied before)."""
    group = axis(mesh, "cp").get_group()
    for _, layer in matching(module, (ctx.plan.linear_attention,) if ctx.plan.linear_attention else ()):
        apply_deltanet_cp(layer, group, module_name=ctx.name)
    return apply_cp(module, group, multiple=ctx.layout.token_multiple, pad_id=ctx.plan.pad_token_id)


def _sp(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    return apply_ulysses_sp(module, mesh, UlyssesSpec(mesh_dim="sp"))


def _cast(module: nn.Module, ctx: _Ctx) -> nn.Module:
    """fsdp == 1 with master weights: the FSDP units (the family's blocks, then the root) cast their
    parameters to the compute dtype while they run (``dhp.parallel.precision.apply_compute_cast``)."""
    blocks = [m for _, m in fsdp_blocks(module, ctx.plan.blocks)]
    apply_compute_cast(module, blocks, dtype=precision_of(ctx.mixed_precision).compute_dtype)
    return module


def _expert_fsdp(module: nn.Module, ctx: _Ctx) -> nn.Module:
    """The experts' own FSDP2 units over ``edp`` (``dhp.parallel.fsdp.apply_expert_fsdp``), before the
    compute cast (which leaves FSDP units to their policy) and the dense FSDP (which leaves them out)."""
    apply_expert_fsdp(module, ctx.mixed_precision)
    return module


@dataclass(frozen=True)
class Step:
    """One strategy: when it is on (a predicate on the config) and how to apply it."""

    name: str
    enabled: Callable[[_Ctx], bool]
    apply: Callable[[nn.Module, DeviceMesh, _Ctx], nn.Module]


def _ac_spec(value: str) -> AcSpec:
    mode = parse_ac_mode(value)
    return AcSpec(kind=mode.kind, every_n_layers=mode.every_n)


STEPS: tuple[Step, ...] = (
    Step(
        "pp",
        lambda c: c.layout.pp > 1,
        lambda m, mesh, c: apply_pp(m, c.layout, dist.get_rank(), tied=bool(c.plan.tied)),
    ),
    Step("ep", lambda c: c.layout.expert_group > 1 or c.layout.expert_fsdp, _ep),
    Step("moe_tokens", lambda c: bool(c.plan.moe_blocks), _token_group),
    Step(
        "tp",
        lambda c: c.layout.tp > 1,
        lambda m, mesh, c: _tp(m, axis(mesh, "tp"), c),
    ),
    Step("loss", lambda c: c.plan.loss and c.layout.tp == 1, lambda m, mesh, c: _loss(m, c)),
    Step("cp", lambda c: c.layout.cp > 1, _cp),
    Step("sp", lambda c: c.layout.sp > 1, lambda m, mesh, c: _sp(m, mesh)),
    Step(
        "expert_fsdp",
        lambda c: c.layout.expert_fsdp,
        lambda m, mesh, c: _expert_fsdp(m, c),
    ),
    Step(
        "cast",
        lambda c: c.layout.fsdp == 1 and precision_of(c.mixed_precision).casts,
        lambda m, mesh, c: _cast(m, c),
    ),
    Step(
        "ac",
        lambda c: parse_ac_mode(c.activation_checkpointing).enabled,
        lambda m, mesh, c: apply_ac(m, mesh, _ac_spec(c.activation_checkpointing)),
    ),
    Step(
        "fsdp",
        lambda c: c.layout.fsdp > 1,
        lambda m, mesh, c: apply_fsdp(
            m, mesh, FsdpSpec(block_globs=c.plan.blocks, mixed_precision=c.mixed_precision)
        ),
    ),
)


def _check(ctx: _Ctx, mesh: DeviceMesh) -> None:
    """PlanError unless the mesh's axis degrees equal the config's and the combination is supported."""
    got = {a: axis_size(mesh, a) for a in AXES}
    want = ctx.layout.degrees
    if got != want:
        raise PlanError(
            f"module {ctx.name!r}: mesh degrees {got} differ from modules.{ctx.name}.parallel {want}."
        )
    problems = module_problems(
        ctx.name,
        gpus=mesh.size(),
        layout=ctx.layout,
        axes=module_axes(ctx.plan),
        gpus_per_node=None,  # the plan placed the mesh; its TP group was checked against the cluster
        activation_checkpointing=ctx.activation_checkpointing,
        mixed_precision=ctx.mixed_precision,
    )
    if problems:
        raise PlanError(f"module {ctx.name!r}: " + "; ".join(str(p) for p in problems))
    if ctx.loss_chunk_tokens < 0:
        raise PlanError(
            f"modules.{ctx.name}.loss_chunk_tokens={ctx.loss_chunk_tokens}: must be >= 0 tokens per "
            "cross-entropy chunk. Fix: 0 (the default, 4096) or a positive token count."
        )


def module_axes(plan: ModuleParallelPlan) -> ModuleAxes:
    """The axes a family's runtime plan supports, in the terms of the plan-validity rule."""
    return ModuleAxes(
        tp=plan.tp is not None,
        sp=bool(plan.sp) or plan.sp_local,
        tp_sequence_parallel=plan.tp_sequence_parallel,
        tp_divides=dict(plan.tp_divides),
        sp_divides=dict(plan.sp_divides),
        experts=plan.experts if plan.moe_blocks else 0,
        cp=plan.cp,
        cp_divides=dict(plan.cp_divides),
        cp_sequence_parallel=plan.cp_sequence_parallel,
        pp=plan.pp,
        pp_layers=plan.pp_layers,
    )


def parallelize(
    module_name: str,
    module: nn.Module,
    mesh: DeviceMesh,
    layout: ParallelLayout,
    *,
    activation_checkpointing: str | bool,
    mixed_precision: str,
    loss_chunk_tokens: int = 0,
) -> nn.Module:
    """Apply ``module_name``'s strategies to ``module`` in place over ``mesh`` and return it.

    ``mesh`` is the group's mesh (axes dp, fsdp, sp, tp with degree > 1). ``mixed_precision`` is the
    module's policy (fp32 | bf16_master_fp32 | bf16, :mod:`dhp.parallel.precision`): ``module``'s
    parameters must already be stored in its parameter dtype (PlanError otherwise); the module then
    computes in its compute dtype, through FSDP2's policy when fsdp > 1 and through the unit cast
    otherwise. ``loss_chunk_tokens``: tokens per chunk of the LLM's
    cross-entropy (0 = ``dhp.ops.DEFAULT_LOSS_CHUNK_TOKENS``). ``layout`` is the group's (the mesh was cut
    from it: dhp.parallel.meshutil.build_mesh); its ``sequence_parallel`` turns on
    sequence parallelism inside the LLM's TP group (nothing to shard at tp=1: a no-op there). Raises
    PlanError before touching the module when the plan is inconsistent or unsupported.
    """
    ctx = _Ctx(
        module_name,
        module_plan(module),
        layout,
        activation_checkpointing,
        mixed_precision,
        loss_chunk_tokens,
    )
    _check(ctx, mesh)
    check_parameter_dtypes(module, precision_of(mixed_precision), module_name=module_name)
    for step in STEPS:
        if step.enabled(ctx):
            module = step.apply(module, mesh, ctx)
    return module
