"""How module phase times combine into a step, by the placement's GPU-sharing sets
(``dhp.config.placement``): the modules of one set run one after the other on its GPUs; sets run at
the same time, the producers' sets encoding a micro-batch while the loss module's set runs the
previous one (a 2-stage pipeline; formulas in ``dhp/plan/timing.py``). Collocated is one set (all
serial), disaggregated a set per module. Also the micro-batches of one step, and the estimate's JSON
document."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig

from dhp.config.placement import Sets, sets_among
from dhp.plan.graph import ModuleGraph


def micro_batches_per_step(train: DictConfig, replicas: int) -> int:
    """Micro-batches each of the loss module's ``replicas`` data replicas runs per optimizer step (gradient
    accumulation) under the ``train`` config."""
    per = train.micro_batch_size * replicas
    return max(1, train.global_batch_size // per)


@dataclass(frozen=True)
class Schedule:
    step_s: float
    bottleneck: str
    idle_s: dict[str, float]


def schedule(
    placement: str,
    per: dict[str, dict[str, float]],
    *,
    graph: ModuleGraph,
    n_mb: int,
    handoff: float,
    dispatch: float = 0.0,
) -> Schedule:
    """Step seconds from per-micro-batch ``fwd_s``/``bwd_s`` and per-step ``grad_sync_s``/``optim_s``
    of the modules in ``per`` (``graph``'s consumer and the producers among them); ``handoff``: the
    seconds of one micro-batch's hand-off from every producer (the hand-back costs as much);
    ``dispatch`` is the driver's own time per micro-batch (Ray calls, routing), added serially."""
    sched = _schedule(placement, per, graph=graph, n_mb=n_mb, handoff=handoff)
    return Schedule(sched.step_s + n_mb * dispatch, sched.bottleneck, sched.idle_s)


def _schedule(
    placement: str, per: dict[str, dict[str, float]], *, graph: ModuleGraph, n_mb: int, handoff: float
) -> Schedule:
    """Per sharing set, its modules' work one after the other; the consumer's set (the consumer's
    forward and backward, both hand-offs, and the producers that share its GPUs) runs micro-batch m
    while each producers-only set encodes micro-batch m+1, so a micro-batch costs the slower of the
    slowest such set and the consumer's set (plus the pipeline's fill), then the longest set's finish
    (its modules' grad syncs and optimizers in turn). One set (collocated): everything in turn,
    bottleneck ``serial (shared GPUs)``; else the consumer, or the first slowest producer of the
    slowest producers' set when that set is slower. A module idles what its set does not work."""
    fin = {n: p["grad_sync_s"] + p["optim_s"] for n, p in per.items()}
    consumer = graph.consumer
    producers = [p for p in graph.producers if p in per]
    sets = sets_among(placement, [*producers, consumer])
    if "pp_bubble_s" in per[consumer]:
        return _pipelined(sets, per, producers, consumer, fin, n_mb=n_mb, handoff=handoff)
    if not producers:
        c = per[consumer]
        return Schedule(n_mb * (c["fwd_s"] + c["bwd_s"]) + fin[consumer], consumer, {consumer: 0.0})
    work = {p: per[p]["fwd_s"] + per[p]["bwd_s"] for p in producers}
    work[consumer] = per[consumer]["fwd_s"] + per[consumer]["bwd_s"] + 2 * handoff
    home = next(g for g in sets if consumer in g)
    shared = [p for p in producers if p in home]  # on the consumer's GPUs: before it, in turn
    lm = sum(work[p] for p in shared) + work[consumer] if shared else work[consumer]
    if len(sets) == 1:
        step = n_mb * lm + sum(fin.values())
        return Schedule(step, "serial (shared GPUs)", {n: 0.0 for n in (*producers, consumer)})
    apart = [g for g in sets if consumer not in g]
    load = {g: sum(work[p] for p in g) for g in apart}
    slow_set = max(apart, key=lambda g: load[g])  # the first of the slowest
    slowest = max(slow_set, key=lambda p: work[p])
    v = load[slow_set]
    step = n_mb * max(v, lm) + min(v, lm) + max(_set_sum(fin, g) for g in sets)
    busy = {g: n_mb * (lm if g is home else load[g]) + _set_sum(fin, g) for g in sets}
    idle = {n: max(step - busy[g], 0.0) for g in sets for n in g}
    return Schedule(step, consumer if lm >= v else slowest, {n: idle[n] for n in (*producers, consumer)})


def _set_sum(values: dict[str, float], group: tuple[str, ...]) -> float:
    """The sum over one sharing set's modules (their phases run in turn on its GPUs)."""
    return sum(values[n] for n in group) if len(group) > 1 else values[group[0]]


def _pipelined(
    sets: Sets,
    per: dict[str, dict[str, float]],
    producers: list[str],
    consumer: str,
    fin: dict[str, float],
    *,
    n_mb: int,
    handoff: float,
) -> Schedule:
    """A consumer with pipeline stages runs every micro-batch of the step in ONE schedule: the
    producers' forwards of every micro-batch run before it, their backwards after it ends (no
    overlap with the consumer, whatever the sets): the producers of one set in turn, the sets side by
    side. The pipeline: its slowest rank's micro-batches, the schedule's bubble, the stage
    boundaries' sends and the hand-off both ways per micro-batch."""
    c = per[consumer]
    lm = n_mb * (c["fwd_s"] + c["bwd_s"] + 2 * handoff) + c["pp_bubble_s"] + c["pp_p2p_s"]
    enc = {p: n_mb * (per[p]["fwd_s"] + per[p]["bwd_s"]) for p in producers}
    groups = [tuple(p for p in g if p in enc) for g in sets]
    serial = max((sum(enc[p] for p in g) for g in groups if g), default=0.0)
    finish = max(_set_sum(fin, g) for g in sets)
    step = serial + lm + finish
    busy = {**{p: enc[p] + fin[p] for p in producers}, consumer: lm + fin[consumer]}
    if len(sets) == 1:
        idle = {n: 0.0 for n in busy}
    else:
        on_set = {n: sum(busy[m] for m in g) for g in sets for n in g}
        idle = {n: max(step - on_set[n], 0.0) for n in busy}
    return Schedule(step, consumer if lm >= serial else max(enc, key=enc.get), idle)


@dataclass(frozen=True)
class StepEstimate:
    """``--json``'s ``estimate``: step time, throughput, MFU and per-module seconds per step."""

    step_time_s: float
    vision_tokens_per_s: float
    text_tokens_per_s: float
    mfu: float
    micro_batches: int
    handoff_s: float
    bottleneck: str
    idle_s: dict[str, float]
    profile: str
    modules: dict[str, dict[str, float]] = field(default_factory=dict)
    provenance: str = "built-in defaults"  # ClusterConfig.provenance: how the profile was obtained

    def to_json(self) -> dict:
        mods = {}
        for name, p in self.modules.items():
            mods[name] = {
                "fwd_s": self.micro_batches * p["fwd_s"],
                "bwd_s": self.micro_batches * p["bwd_s"],
                "comm_s": p["comm_s"],
                "optim_s": p["optim_s"],
                "grad_sync_s": p["grad_sync_s"],
                "idle_s": self.idle_s.get(name, 0.0),
                "recompute_tflops": p["recompute_flops"] / 1e12,
                "tflops_per_rank": p["flops_per_rank"] / 1e12,
                "a2a_s": p["a2a_s"],  # EP dispatch + combine of the step, inside comm_s
            }
            if "pp_bubble_s" in p:  # a pipeline: its schedule's idle time and stage sends per step
                mods[name] |= {"pp_bubble_s": p["pp_bubble_s"], "pp_p2p_s": p["pp_p2p_s"]}
        return {
            "step_time_s": self.step_time_s,
            "vision_tokens_per_s": self.vision_tokens_per_s,
            "text_tokens_per_s": self.text_tokens_per_s,
            "mfu": self.mfu,
            "micro_batches": self.micro_batches,
            "handoff_s": self.handoff_s,
            "bottleneck": self.bottleneck,
            "profile": self.profile,
            "provenance": self.provenance,
            "modules": mods,
        }
