"""``parallelize``: apply a module's strategies in a fixed order from data, with no strategy if/elif chains.

Order (torchtitan's): TP -> Ulysses SP -> activation checkpointing -> FSDP2. TP and SP change what a
rank computes; AC wraps the (already parallel) layers; FSDP shards whatever parameters are left last,
so it sees TP DTensors as 2-D. DP needs nothing at this point: its gradient SUM is
:func:`dhp.parallel.optim.finalize_grads` and ZeRO-1 is :func:`dhp.parallel.optim.build_optimizer`.

What each module supports is data (:data:`MODULE_PLANS`); what each strategy does is one
``apply_<x>(module, mesh, spec)``; the table :data:`STEPS` says when a strategy is on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dhp.config.ac import parse_ac_mode
from dhp.config.schema import ParallelConfig
from dhp.errors import PlanError
from dhp.parallel.ac import AcSpec, apply_ac
from dhp.parallel.fsdp import FsdpSpec, apply_fsdp, mixed_precision_policy
from dhp.parallel.llm_tp import apply_tp, llm_tp_plan
from dhp.parallel.meshutil import AXES, axis, axis_size


def _llm_tp(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    return apply_tp(module, mesh, llm_tp_plan())


def _vision_tp(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    from dhp.parallel.vision_tp import apply_vision_tp  # issue #4 part 1

    return apply_vision_tp(module, mesh)


def _vision_sp(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    from dhp.parallel.ulysses import UlyssesSpec, apply_ulysses_sp  # issue #4 part 1

    return apply_ulysses_sp(module, mesh, UlyssesSpec(mesh_dim="sp"))


@dataclass(frozen=True)
class ModulePlan:
    """What the strategies need to know about one module: its TP/SP appliers (None: unsupported) and
    the FQN globs of its repeated blocks (FSDP units)."""

    tp: Callable[[nn.Module, DeviceMesh], nn.Module] | None
    sp: Callable[[nn.Module, DeviceMesh], nn.Module] | None
    blocks: tuple[str, ...]


MODULE_PLANS: dict[str, ModulePlan] = {
    "llm": ModulePlan(tp=_llm_tp, sp=None, blocks=("language_model.layers.*",)),
    "vision": ModulePlan(tp=_vision_tp, sp=_vision_sp, blocks=("visual.blocks.*",)),
}


@dataclass(frozen=True)
class _Ctx:
    name: str
    plan: ModulePlan
    parallel: ParallelConfig
    activation_checkpointing: str  # a dhp.config.ac mode (bools accepted)
    mixed_precision: str


@dataclass(frozen=True)
class Step:
    """One strategy: when it is on (a predicate on the config) and how to apply it."""

    name: str
    enabled: Callable[[_Ctx], bool]
    apply: Callable[[nn.Module, DeviceMesh, _Ctx], nn.Module]


def _need(fn, what: str, ctx: _Ctx):
    if fn is None:
        raise PlanError(
            f"module {ctx.name!r} does not support {what} (modules.{ctx.name}.parallel.{what}>1). "
            f"Fix: use {'tp' if what == 'sp' else 'sp'} or fsdp/dp for this module."
        )
    return fn


STEPS: tuple[Step, ...] = (
    Step(
        "tp", lambda c: c.parallel.tp > 1, lambda m, mesh, c: _need(c.plan.tp, "tp", c)(m, axis(mesh, "tp"))
    ),
    Step("sp", lambda c: c.parallel.sp > 1, lambda m, mesh, c: _need(c.plan.sp, "sp", c)(m, mesh)),
    Step(
        "ac",
        lambda c: parse_ac_mode(c.activation_checkpointing).enabled,
        lambda m, mesh, c: apply_ac(
            m, mesh, AcSpec(every_n_layers=parse_ac_mode(c.activation_checkpointing).every_n)
        ),
    ),
    Step(
        "fsdp",
        lambda c: c.parallel.fsdp > 1,
        lambda m, mesh, c: apply_fsdp(
            m, mesh, FsdpSpec(block_globs=c.plan.blocks, mixed_precision=c.mixed_precision)
        ),
    ),
)


def _check(ctx: _Ctx, mesh: DeviceMesh) -> None:
    """PlanError unless the mesh's axis degrees equal the config's and the combination is supported."""
    got = {a: axis_size(mesh, a) for a in AXES}
    want = {a: getattr(ctx.parallel, a) for a in AXES}
    if got != want:
        raise PlanError(
            f"module {ctx.name!r}: mesh degrees {got} differ from modules.{ctx.name}.parallel {want}."
        )
    if ctx.parallel.sp > 1 and ctx.parallel.tp > 1:
        raise PlanError(
            f"modules.{ctx.name}.parallel: sp and tp are mutually exclusive. Fix: set one of them to 1."
        )
    mixed_precision_policy(ctx.mixed_precision)
    if parse_ac_mode(ctx.activation_checkpointing).kind == "selective":
        raise PlanError(
            f"modules.{ctx.name}.activation_checkpointing=selective is not implemented yet. "
            "Fix: use full or every_n:K."
        )


def parallelize(
    module_name: str,
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    parallel: ParallelConfig,
    activation_checkpointing: str | bool,
    mixed_precision: str,
) -> nn.Module:
    """Apply ``module_name``'s strategies to ``module`` in place over ``mesh`` and return it.

    ``mesh`` is the group's mesh (axes dp, fsdp, sp, tp with degree > 1). ``mixed_precision`` is the
    FSDP2 policy (fp32 | bf16_master_fp32 | bf16); without FSDP parameters keep their dtype and the
    caller chooses the compute dtype. Raises PlanError before touching the module when the plan is
    inconsistent or unsupported.
    """
    if module_name not in MODULE_PLANS:
        raise PlanError(f"no parallel plan for module {module_name!r}; known: {sorted(MODULE_PLANS)}.")
    ctx = _Ctx(module_name, MODULE_PLANS[module_name], parallel, activation_checkpointing, mixed_precision)
    _check(ctx, mesh)
    for step in STEPS:
        if step.enabled(ctx):
            module = step.apply(module, mesh, ctx)
    return module
