"""The space of valid plans: one rule, asked by validation, the ``--auto`` search and ``parallelize``.

:func:`module_problems` answers "is this plan valid for this module, and if not why" for one
module's GPU count, its :class:`~dhp.layout.ParallelLayout` (dp, fsdp, sp, tp, the expert-parallel
degree ep, ZeRO-1, sequence parallelism inside TP), the axes the
module supports (:class:`~dhp.models.arch.ModuleAxes`, declared by its family), a TP group inside one
node, the activation-checkpointing mode and the mixed-precision policy. :func:`placement_problems`
answers it for the modules together: placement, the cluster's GPUs, N:M routing of replicas and the
hand-off. Each problem is a :class:`~dhp.errors.ConfigIssue` (key path, value, rule, fix).

- ``dhp.validation.validate`` turns the problems into the ConfigError of a run config;
- ``dhp.plan.search`` generates only degrees with no problem, so ``--auto`` never offers a plan the
  runtime refuses;
- ``dhp.parallel.parallelize`` raises PlanError on any problem before touching the module.

Pure: no torch. The degrees come as a layout (``dhp.layout.module_layout`` of a config node, or a
search candidate), never as a config node: the rule checks the layout the runtime will use.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dhp.config.ac import parse_ac_mode
from dhp.config.constants import HANDOFFS, MIXED_PRECISIONS
from dhp.config.handoff import run_handoff
from dhp.config.issues import Issues
from dhp.config.placement import parse_placement
from dhp.errors import ConfigIssue
from dhp.layout import MULTI_STAGE_SCHEDULES, PP_SCHEDULES, ParallelLayout, stage_cut


@dataclass(frozen=True)
class ModuleAxes:
    """Which parallel axes one module of a family supports, and the sizes each degree must divide.

    ``tp``/``sp``: tensor parallelism / Ulysses SP exist for the module; ``tp_divides``/``sp_divides``
    name every size the degree must divide (each rank holds 1/degree of it); ``tp_sequence_parallel``:
    Megatron sequence parallelism inside the TP group exists. ``fsdp`` and ``dp`` apply to any module.
    ``experts``: the expert count every sparse-MoE block of the module has (0: no MoE block, so
    ``ep`` must stay 1); the torch-free side reads it from the typed architecture's
    ``Mlp(kind="moe", experts=...)`` (:func:`with_experts`). The plan-validity rule (``dhp.config.plan_space``) reads this; the runtime's
    ``ModuleParallelPlan`` describes the same facts (a test keeps them equal).
    """

    tp: bool
    sp: bool
    tp_sequence_parallel: bool
    tp_divides: Mapping[str, int] = field(default_factory=dict)
    sp_divides: Mapping[str, int] = field(default_factory=dict)
    experts: int = 0
    #: context parallelism exists for the module (its family computes positions on the whole sequence and
    #: cuts its tokens: ``dhp.parallel.cp``); ``cp_divides``: sizes cut over tp, then each TP rank's share
    #: over cp (a hybrid decoder's linear-attention heads), so tp * cp must divide them;
    #: ``cp_sequence_parallel``: CP composes with Megatron sequence parallelism inside TP
    cp: bool = False
    cp_divides: Mapping[str, int] = field(default_factory=dict)
    cp_sequence_parallel: bool = True
    #: pipeline parallelism exists for the module (its runtime cuts it by decoder layers into
    #: ``pp x pp_virtual`` stages: ``dhp.layout.stage_cut``); ``pp_layers``: the decoder layers a cut
    #: divides (every stage needs at least one)
    pp: bool = False
    pp_layers: int = 0
    #: the module's settings that pipeline stages cannot run with, ``{config key: (value, why)}``
    #: (tied word embeddings: the embedding and lm_head sit on different stages; a non-zero router
    #: load-balancing coefficient: its loss is a sum over every stage's layers)
    pp_refused: Mapping[str, tuple[Any, str]] = field(default_factory=dict)


def moe_experts(blocks: Iterable[Any]) -> int:
    """The expert count an EP degree must divide, from typed-architecture blocks (``block.mlp.kind``
    / ``block.mlp.experts``): the gcd over the MoE blocks (all equal in practice), 0 without any."""
    return math.gcd(*(int(b.mlp.experts) for b in blocks if b.mlp.kind == "moe"))


def with_experts(axes: ModuleAxes, blocks: Iterable[Any]) -> ModuleAxes:
    """``axes`` with ``experts`` read from the module's typed-architecture blocks (:func:`moe_experts`)."""
    return replace(axes, experts=moe_experts(blocks))


def declared_axes(family_arch: Any, name: str, model: Any) -> ModuleAxes:
    """What module ``name`` supports, as its family declares it torch-free: ``family_arch.module_axes``
    with ``experts`` from ``family_arch.architecture(model)`` (validation and the search both ask this)."""
    axes = family_arch.module_axes(name, model)
    return with_experts(axes, family_arch.architecture(model).modules[name].blocks)


def _degree_problems(prefix: str, gpus: int, lay: ParallelLayout, out: Issues) -> bool:
    degs = lay.degrees
    ok = True
    for axis, d in degs.items():
        ok &= out.check(d >= 1, f"{prefix}.parallel.{axis}", d, "must be >= 1", "use 1 to disable")
    ok &= out.check(gpus > 0, f"{prefix}.gpus", gpus, "must be > 0", "set the GPU count of this group")
    zero = lay.zero
    out.check(
        zero in (0, 1),
        f"{prefix}.parallel.zero",
        zero,
        "must be 0 (plain DP) or 1 (ZeRO-1)",
        "use fsdp=N for ZeRO-3-style sharding",
    )
    out.check(
        not (zero == 1 and degs["fsdp"] > 1),
        f"{prefix}.parallel.zero",
        zero,
        "ZeRO-1 and FSDP both shard the optimizer state",
        "set zero=0 when fsdp > 1",
    )
    out.check(
        not (degs["cp"] > 1 and degs["sp"] > 1),
        f"{prefix}.parallel",
        {"cp": degs["cp"], "sp": degs["sp"]},
        "cp and sp are mutually exclusive inside one module (both cut the module's sequence)",
        "set one of them to 1 (sp for an encoder's patches, cp for the LLM's tokens)",
    )
    out.check(
        not (degs["sp"] > 1 and degs["tp"] > 1),
        f"{prefix}.parallel",
        {"sp": degs["sp"], "tp": degs["tp"]},
        "sp and tp are mutually exclusive inside one module",
        "set one of them to 1 (sp for long encoder sequences, tp for wide layers)",
    )
    if ok:
        product = lay.world_size
        out.check(
            product == gpus,
            f"{prefix}.gpus",
            gpus,
            "must equal "
            + "*".join(degs)
            + " = "
            + "*".join(str(d) for d in degs.values())
            + f" = {product}",
            f"set {prefix}.gpus={product} or change the degrees",
        )
    return ok  # False: a degree or the GPU count < 1 (nothing below may divide by it)


def layout_ok(gpus: int, layout: ParallelLayout) -> bool:
    """The mesh degrees are >= 1 and multiply to ``gpus`` (what every rank-layout computation needs)."""
    return gpus > 0 and min(layout.degrees.values()) >= 1 and layout.world_size == gpus


def _divides(out: Issues, path: str, degree: int, sizes: Mapping[str, int]) -> None:
    axis = path.rsplit(".", 1)[1]
    for key, size in sizes.items():
        out.check(
            degree <= 1 or size % degree == 0,
            path,
            degree,
            f"{key}={size} is not divisible by {axis}={degree} (each rank holds 1/{axis} of it)",
            f"choose {axis} among the divisors of {size}",
        )


def _axes_problems(prefix: str, lay: ParallelLayout, axes: ModuleAxes, out: Issues) -> None:
    sp, tp, seq = lay.sp, lay.tp, lay.sequence_parallel
    if out.check(
        sp == 1 or axes.sp,
        f"{prefix}.parallel.sp",
        sp,
        "this module does not support sp (Ulysses sequence parallelism)",
        "use tp (and dp/fsdp) for this module",
    ):
        _divides(out, f"{prefix}.parallel.sp", sp, axes.sp_divides)
    if out.check(
        tp == 1 or axes.tp,
        f"{prefix}.parallel.tp",
        tp,
        "this module does not support tp",
        "use sp (and dp/fsdp) for this module",
    ):
        _divides(out, f"{prefix}.parallel.tp", tp, axes.tp_divides)
    cp = lay.cp
    if out.check(
        cp == 1 or axes.cp,
        f"{prefix}.parallel.cp",
        cp,
        "this module does not support cp (context parallelism)",
        "set cp=1 and use tp (with sequence_parallel) or fsdp for this module's sequence memory",
    ):
        for key, size in axes.cp_divides.items():
            out.check(
                cp <= 1 or size % (cp * tp) == 0,
                f"{prefix}.parallel.cp",
                cp,
                f"{key}={size} is not divisible by tp*cp={tp}*{cp} (each TP rank's share is cut over cp)",
                f"choose cp and tp whose product divides {size}",
            )
        out.check(
            cp <= 1 or not seq or axes.cp_sequence_parallel,
            f"{prefix}.parallel.sequence_parallel",
            seq,
            "this module's linear-attention layers gather their whole sequence under cp, which sequence "
            "parallelism inside TP would cut again",
            "set sequence_parallel=false when cp > 1",
        )
    out.check(
        not seq or axes.tp_sequence_parallel,
        f"{prefix}.parallel.sequence_parallel",
        seq,
        "this module has no sequence parallelism inside TP",
        "set it to false",
    )
    ep = lay.ep
    if ep > 1 and out.check(
        axes.experts > 0,
        f"{prefix}.parallel.ep",
        ep,
        "this module has no mixture-of-experts blocks to shard (expert parallelism needs an MoE family)",
        "set ep=1",
    ):
        _divides(out, f"{prefix}.parallel.ep", ep, {"number of experts": axes.experts})
    moe_axes = {"etp": lay.etp > 1, "expert_fsdp": lay.expert_fsdp}
    for key, on in moe_axes.items():
        if on:
            out.check(
                axes.experts > 0,
                f"{prefix}.parallel.{key}",
                getattr(lay, key),
                "this module has no mixture-of-experts blocks (expert TP and expert FSDP need an MoE family)",
                f"set {key}={'1' if key == 'etp' else 'false'}",
            )
    group = lay.expert_group
    if group > 1 and axes.experts > 0 and lay.etp > 1:
        out.check(
            axes.experts % group == 0,
            f"{prefix}.parallel.etp",
            lay.etp,
            f"number of experts={axes.experts} is not divisible by ep x etp = {lay.ep} x {lay.etp} "
            "(each rank of an all-to-all group holds 1/(ep x etp) of them)",
            f"choose ep x etp among the divisors of {axes.experts}",
        )


def _pipeline_problems(prefix: str, lay: ParallelLayout, axes: ModuleAxes | None, out: Issues) -> None:
    """The pipeline's degrees (``pp``, ``pp_virtual``, ``pp_schedule``) against each other and, with
    ``axes``, against what the module supports. The micro-batch count the schedule needs is a
    run-level fact: :func:`pipeline_micro_batch_problems`."""
    key = f"{prefix}.parallel"
    sched, v, pp = lay.pp_schedule, lay.pp_virtual, lay.pp
    out.check(v >= 1, f"{key}.pp_virtual", v, "must be >= 1", "use 1 (one stage per pipeline rank)")
    if out.one_of(sched, f"{key}.pp_schedule", PP_SCHEDULES) and v >= 1:
        multi = sched in MULTI_STAGE_SCHEDULES
        out.check(
            (v >= 2) == multi,
            f"{key}.pp_virtual",
            v,
            f"pp_schedule={sched} runs several stages per rank, so it needs pp_virtual >= 2"
            if multi
            else f"pp_schedule={sched} runs one stage per rank, so it needs pp_virtual=1",
            f"set pp_virtual=2 (or pp_schedule={'1f1b' if multi else 'interleaved_1f1b'})"
            if multi
            else f"set pp_virtual=1 (or pp_schedule=interleaved_1f1b for {v} stages per rank)",
        )
    if pp <= 1:
        return
    out.check(
        lay.cp == 1,
        f"{key}.cp",
        lay.cp,
        "pipeline stages do not compose with context parallelism (pp > 1)",
        "set cp=1, or pp=1 and keep cp",
    )
    out.check(
        lay.seq_split == 1,  # at tp = 1 sequence parallelism cuts nothing
        f"{key}.sequence_parallel",
        True,
        "pipeline stages pass whole-sequence hidden states between stages, which sequence parallelism "
        "inside TP cuts (pp > 1, tp > 1)",
        "set sequence_parallel=false when pp > 1",
    )
    if axes is None:
        return
    if not out.check(
        axes.pp,
        f"{key}.pp",
        pp,
        "this module does not support pipeline stages (pp > 1: only the LLM, cut by decoder layers)",
        "set pp=1 and use tp/fsdp (or sp) for this module",
    ):
        return
    stages = lay.num_stages
    out.check(
        stages <= axes.pp_layers,
        f"{key}.pp",
        pp,
        f"pp x pp_virtual = {pp} x {v} = {stages} stages, but the module has {axes.pp_layers} decoder "
        "layers (every stage needs at least one)",
        f"choose pp x pp_virtual <= {axes.pp_layers}",
    )
    cut = list(lay.pp_cut)
    if cut and stages <= axes.pp_layers:
        out.check(
            len(cut) == stages and min(cut) >= 1 and sum(cut) == axes.pp_layers,
            f"{key}.pp_cut",
            cut,
            f"the cut gives each of the pp x pp_virtual = {stages} stages its decoder layers: {stages} "
            f"counts >= 1 that sum to the module's {axes.pp_layers} layers",
            f"e.g. pp_cut={[hi - lo for lo, hi in stage_cut(axes.pp_layers, stages)]} (the balanced cut, "
            "also what [] gives)",
        )
    for path, (value, why) in axes.pp_refused.items():
        out.check(False, path, value, f"pipeline stages ({key}.pp={pp}) cannot run with it: {why}",
                  f"set {key}.pp=1")  # fmt: skip


def pipeline_micro_batches(lay: ParallelLayout, micro_batches: int) -> str | None:
    """Why ``micro_batches`` pipeline micro-batches per step cannot run ``lay``'s schedule (None: they
    can), as torch.distributed.pipelining requires: ``1f1b`` at least one per stage (``pp``);
    ``interleaved_1f1b`` and ``zero_bubble`` a multiple of their rounds, ``max(1, M // pp)`` (their
    micro-batches go through the pipeline in rounds of equal size); ``gpipe`` any count."""
    m, pp = micro_batches, lay.pp
    if lay.pp_schedule == "1f1b" and m < pp:
        return f"pp_schedule=1f1b needs at least pp={pp} micro-batches per step, one per stage"
    if lay.pp_schedule in MULTI_STAGE_SCHEDULES:
        rounds = max(1, m // pp)
        if m % rounds:
            return (
                f"pp_schedule={lay.pp_schedule} runs the micro-batches in max(1, M // pp) = {rounds} "
                f"rounds of equal size, so M={m} must be a multiple of {rounds}"
            )
    return None


def pipeline_micro_batch_problems(
    name: str, lay: ParallelLayout, *, global_batch_size: int, micro_batch_size: int
) -> list[ConfigIssue]:
    """The pipeline schedule of module ``name`` against the step's micro-batches per replica,
    ``M = global_batch_size / (micro_batch_size x dp x fsdp)`` (:func:`pipeline_micro_batches`); empty
    at pp=1 or for an unknown schedule (reported by :func:`module_problems`)."""
    if lay.pp <= 1 or lay.pp_schedule not in PP_SCHEDULES or micro_batch_size <= 0:
        return []
    m = max(1, global_batch_size // (micro_batch_size * lay.num_replicas))
    why = pipeline_micro_batches(lay, m)
    if why is None:
        return []
    unit = micro_batch_size * lay.num_replicas
    return [
        ConfigIssue(
            "train.global_batch_size",
            global_batch_size,
            f"{why} (modules.{name}: M = global_batch_size / (micro_batch_size x dp x fsdp) = "
            f"{global_batch_size} / {unit} = {m})",
            f"use a global_batch_size that is a multiple of micro_batch_size x dp x fsdp x pp = "
            f"{unit * lay.pp} (e.g. {unit * lay.pp} or {2 * unit * lay.pp}), or another pp_schedule",
        )
    ]


def split_backward_refuses(lay: ParallelLayout, activation_checkpointing: Any) -> bool:
    """Whether the zero-bubble schedule's split backward (input, then weight gradients: two passes)
    meets what it cannot run: op-level (selective) activation checkpointing, which allows one backward
    per region, or parameters under FSDP2 (torch's weight pass looks up their gradient accumulators,
    which FSDP2's sharded parameters replace: a KeyError) or the expert axes (not proven with it)."""
    if lay.pp <= 1 or lay.pp_schedule != "zero_bubble":
        return False
    if lay.fsdp > 1 or lay.ep > 1 or lay.expert_fsdp:
        return True
    try:
        return parse_ac_mode(activation_checkpointing).kind == "selective"
    except ValueError:
        return False  # an unknown mode is reported by module_problems itself


def _ep_problems(prefix: str, lay: ParallelLayout, out: Issues) -> None:
    """EP folds over the ranks that see different tokens (dp x fsdp x sp, ``dhp.layout.TOKEN_AXES``)."""
    ep = lay.ep
    if not out.check(ep >= 1, f"{prefix}.parallel.ep", ep, "must be >= 1", "use 1 to disable"):
        return
    folded = lay.token_ranks
    out.check(
        folded % ep == 0,
        f"{prefix}.parallel.ep",
        ep,
        f"the EP group is folded from the dp x fsdp x sp ranks ({folded}), which ep must divide",
        f"choose ep among the divisors of {folded}, or raise dp/fsdp",
    )
    etp = lay.etp
    out.check(
        etp in (1, lay.tp),
        f"{prefix}.parallel.etp",
        etp,
        f"expert TP cuts the experts' work over all of a unit's TP ranks or none: it must be 1 or tp={lay.tp}",
        f"set etp=1 (every TP rank runs the same experts) or etp={lay.tp}"
        if lay.tp > 1
        else "set etp=1 (expert TP needs tp > 1), or raise tp and set etp to it",
    )
    out.check(
        not (etp > 1 and lay.sequence_parallel),
        f"{prefix}.parallel.sequence_parallel",
        True,
        "expert TP cuts a unit's tokens over its TP ranks itself; sequence parallelism inside TP would "
        "cut them again",
        "set sequence_parallel=false when etp > 1",
    )
    out.check(
        not lay.expert_fsdp or lay.edp > 1,
        f"{prefix}.parallel.expert_fsdp",
        True,
        f"expert FSDP shards the experts over their edp ranks (dp x fsdp x cp x sp / ep = {lay.edp}), "
        "and there is only one",
        "set expert_fsdp=false, or raise dp/fsdp (or lower ep) so that edp > 1",
    )
    out.check(
        not (ep > 1 and lay.tp > 1 and lay.sequence_parallel),
        f"{prefix}.parallel.sequence_parallel",
        True,
        "sequence parallelism inside TP gives each TP rank different tokens, which expert parallelism "
        "(folded over dp x fsdp x sp only) does not route",
        "set sequence_parallel=false when ep > 1",
    )


def module_problems(
    name: str,
    *,
    gpus: int,
    layout: ParallelLayout,
    axes: ModuleAxes | None,
    gpus_per_node: int | None,
    activation_checkpointing: Any,
    mixed_precision: str,
) -> list[ConfigIssue]:
    """Every reason module ``name``'s plan is invalid (empty: valid).

    ``layout``: the module's degrees (``dhp.layout.module_layout`` of its config node);
    ``axes``: what the module supports (None: not known here, e.g. the family failed validation);
    ``gpus_per_node``: a TP group must fit inside and tile one node (None: no cluster to check).
    """
    prefix = f"modules.{name}"
    out = Issues()
    out.one_of(mixed_precision, f"{prefix}.mixed_precision", MIXED_PRECISIONS)
    try:
        parse_ac_mode(activation_checkpointing)
    except ValueError as e:
        out.check(False, f"{prefix}.activation_checkpointing", activation_checkpointing, str(e),
                  f"set {prefix}.activation_checkpointing=full (or off, selective, every_n:2)")  # fmt: skip
    if not _degree_problems(prefix, gpus, layout, out):
        return out.items  # a degree < 1: divisibility would divide by zero
    _pipeline_problems(prefix, layout, axes, out)
    if layout.pp > 1 and layout.pp_schedule == "zero_bubble":
        out.check(
            not split_backward_refuses(layout, activation_checkpointing),
            f"{prefix}.parallel.pp_schedule",
            "zero_bubble",
            "the zero-bubble schedule runs each backward in two passes (input, then weight gradients), "
            "which op-level (selective) checkpointing (one backward per region), FSDP2's sharded "
            "parameters and the expert axes (ep, expert_fsdp) do not support here",
            "use pp_schedule=interleaved_1f1b, or with zero_bubble full/every_n:K/off checkpointing, "
            "fsdp=1 and ep=1 (dp, ZeRO-1 and tp compose with it)",
        )
    _ep_problems(prefix, layout, out)
    tp = layout.tp
    if gpus_per_node is not None and tp > 1:
        out.check(
            tp <= gpus_per_node and gpus_per_node % tp == 0,
            f"{prefix}.parallel.tp",
            tp,
            f"a TP group must stay inside one node and tile it (cluster.gpus_per_node={gpus_per_node})",
            f"use a divisor of {gpus_per_node} and scale with dp/fsdp across nodes",
        )
    if axes is not None:
        _axes_problems(prefix, layout, axes, out)
    return out.items


def placement_problems(
    gpus: Mapping[str, int],
    replicas: Mapping[str, int],
    *,
    placement: str,
    handoff: str,
    device: str,
    total_gpus: int,
    consumer: str | None = None,
) -> list[ConfigIssue]:
    """Every reason the modules cannot run together (empty: they can): the placement and its
    GPU-sharing sets (``dhp.config.placement``: equal GPU counts inside a set, the sets' sum within the
    cluster), N:M routing (one module's replicas divide the other's) and the hand-off of every edge
    into ``consumer`` (the loss module; None: the modules' placement as a whole) for this device.
    ``gpus``/``replicas``: per module, of modules whose own plan is valid."""
    out = Issues()
    sets, problem = parse_placement(placement, list(gpus))
    rule, _, fix = str(problem).partition(". Fix: ")
    if out.check(problem is None, "placement", placement, rule, fix):
        for group in sets:
            counts = {m: gpus[m] for m in group}
            shared = "every module" if len(sets) == 1 else f"the modules of the sharing set {'+'.join(group)}"
            out.check(
                len(set(counts.values())) <= 1,
                "placement",
                placement,
                f"{shared} must share one GPU set, but the GPU counts differ: {counts}",
                "give the modules of a set the same gpus, or put them in different sets "
                "(placement=disaggregated, or a partition such as a+b/c)",
            )
        need = sum(max(gpus[m] for m in group) for group in sets)
        out.check(
            need <= total_gpus,
            "cluster",
            total_gpus,
            f"the {placement} groups need {need} GPUs but the cluster has {total_gpus}",
            "use a larger cluster profile or fewer GPUs per module",
        )
        if out.one_of(handoff, "handoff", HANDOFFS):
            _, problem = run_handoff(device=device, sets=sets, consumer=consumer, handoff=handoff)
            out.check(
                problem is None,
                "handoff",
                handoff,
                f"{problem} (cluster.device={device}, placement={placement})",
                "use handoff=auto",
            )
    reps = {m: r for m, r in replicas.items() if r > 0}
    # N:M routing: each producer's replicas and the consumer's divide one another (without a
    # consumer, every pair of modules)
    if consumer in reps:
        pairs = [(p, consumer) for p in reps if p != consumer]
    else:
        pairs = list(itertools.combinations(reps, 2))
    for a, b in pairs:
        out.check(
            max(reps[a], reps[b]) % min(reps[a], reps[b]) == 0,
            f"modules.{a}.parallel",
            {a: reps[a], b: reps[b]},
            f"data-parallel replicas (dp*fsdp) of {a} ({reps[a]}) and {b} ({reps[b]}) must divide one "
            "another for N:M routing (one replica serves a whole number of the other's)",
            "make one replica count a multiple of the other",
        )
    return out.items
