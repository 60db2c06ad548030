"""The degrees ``dhp plan --auto`` tries for one module on some GPUs: every layout the plan-validity
rule (:func:`dhp.config.plan_space.module_problems`) accepts, from the axes the module declares."""

from __future__ import annotations

import itertools

from dhp.config.plan_space import module_problems
from dhp.layout import ParallelLayout
from dhp.models.arch import ModuleAxes


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def module_degrees(
    name: str, world: int, *, axes: ModuleAxes, gpus_per_node: int, mixed_precision: str
) -> list[ParallelLayout]:
    """Every (pp, pp_virtual, pp_schedule, dp, fsdp, cp, sp, tp, zero, sequence_parallel, ep, etp,
    expert_fsdp) of module ``name`` on ``world`` GPUs that the plan-validity rule
    (:func:`dhp.config.plan_space.module_problems`) accepts: the runtime's space (cp > 1 only where the
    module declares context parallelism; ep > 1, etp = tp and expert_fsdp only where it declares
    expert parallelism, ep dividing the token ranks dp x fsdp x cp x sp, ep x etp the experts,
    expert_fsdp with edp > 1; pipeline stages only where it declares pp, :func:`_pipelines`). The
    step's micro-batch count is checked per candidate (``pipeline_micro_batches``)."""
    out = []
    for pp, v, sched in _pipelines(world, axes=axes):
        out += [
            d.replace(pp=pp, pp_virtual=v, pp_schedule=sched) for d in _stage_degrees(world, pp, axes=axes)
        ]
    return [
        d
        for d in out
        if not module_problems(
            name,
            gpus=world,
            layout=d,
            axes=axes,
            gpus_per_node=gpus_per_node,
            activation_checkpointing="off",
            mixed_precision=mixed_precision,
        )
    ]


#: the pipelines the search tries where the module declares pp: (pp_virtual, schedule); gpipe is left
#: out (1f1b's bubble with more micro-batches in flight)
PIPELINE_CHOICES = ((1, "1f1b"), (2, "interleaved_1f1b"), (2, "zero_bubble"))
PIPELINE_DEGREES = (2, 4, 8)


def _pipelines(world: int, *, axes: ModuleAxes) -> list[tuple[int, int, str]]:
    """(pp, pp_virtual, schedule) of the search: no pipeline, then pp in PIPELINE_DEGREES dividing
    ``world`` with every PIPELINE_CHOICES entry, where the module declares pp (the rule checks the
    rest: stages <= layers, no cp / sequence parallelism, the refused settings)."""
    out = [(1, 1, "1f1b")]
    if axes.pp and not axes.pp_refused:
        out += [(pp, v, s) for pp in PIPELINE_DEGREES if world % pp == 0 for v, s in PIPELINE_CHOICES]
    return out


def _stage_degrees(world: int, pp: int, *, axes: ModuleAxes) -> list[ParallelLayout]:
    """The degrees of one pipeline stage's ``world / pp`` ranks (every axis but pp)."""
    world //= pp
    out = []
    for tp, sp, cp, fsdp in _splits(world, cp=axes.cp and pp == 1):
        dp = world // (tp * sp * cp * fsdp)
        eps = divisors(dp * fsdp * cp * sp) if axes.experts else [1]
        etps = sorted({1, tp}) if axes.experts else [1]
        efsdps = (False, True) if axes.experts else (False,)
        for z, q, ep, etp, efsdp in itertools.product((0, 1), (False, True), eps, etps, efsdps):
            d = ParallelLayout(
                dp=dp, fsdp=fsdp, cp=cp, sp=sp, tp=tp, ep=ep, etp=etp, expert_fsdp=efsdp, zero=z,
                sequence_parallel=q,
            )  # fmt: skip
            if (z and dp * cp * sp == 1) or (q and (tp == 1 or pp > 1)):
                continue  # ZeRO-1 over one rank, SP inside TP of one rank (or refused by pp): a no-op
            out.append(d)
    return out


def _splits(world: int, *, cp: bool) -> list[tuple[int, int, int, int]]:
    """(tp, sp, cp, fsdp) whose product divides ``world`` (dp takes the rest); cp = 1 unless the
    module declares context parallelism."""
    out = []
    for tp in divisors(world):
        for sp in divisors(world // tp):
            for c in divisors(world // (tp * sp)) if cp else [1]:
                out += [(tp, sp, c, f) for f in divisors(world // (tp * sp * c))]
    return out
