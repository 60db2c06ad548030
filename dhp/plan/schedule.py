"""How module phase times combine into a step: serial when collocated, a 2-stage pipeline when
disaggregated (the producers side by side, then the loss module; formulas in ``dhp/plan/timing.py``),
the micro-batches of one step, and the estimate's JSON document."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig

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
    """Collocated: every module's phases in turn on the shared GPUs. Disaggregated (producers on
    GPUs of their own, apart from each other and from the consumer): the producers encode a
    micro-batch side by side while the consumer runs the previous one, so a micro-batch costs the
    slower of the slowest producer and the consumer (plus the pipeline's fill), then the longest
    finish; the bottleneck is the consumer, or the first slowest producer when it is slower."""
    fin = {n: p["grad_sync_s"] + p["optim_s"] for n, p in per.items()}
    consumer = graph.consumer
    producers = [p for p in graph.producers if p in per]
    if "pp_bubble_s" in per[consumer]:
        return _pipelined(placement, per, producers, consumer, fin, n_mb=n_mb, handoff=handoff)
    if not producers:
        c = per[consumer]
        return Schedule(n_mb * (c["fwd_s"] + c["bwd_s"]) + fin[consumer], consumer, {consumer: 0.0})
    work = {p: per[p]["fwd_s"] + per[p]["bwd_s"] for p in producers}
    lm = per[consumer]["fwd_s"] + per[consumer]["bwd_s"] + 2 * handoff
    if placement == "collocated":
        step = n_mb * (sum(work.values()) + lm) + sum(fin.values())
        return Schedule(step, "serial (shared GPUs)", {n: 0.0 for n in (*producers, consumer)})
    slowest = max(producers, key=lambda p: work[p])  # the first of the slowest
    v = work[slowest]
    step = n_mb * max(v, lm) + min(v, lm) + max(fin.values())
    busy = {**{p: n_mb * work[p] + fin[p] for p in producers}, consumer: n_mb * lm + fin[consumer]}
    return Schedule(step, consumer if lm >= v else slowest, {n: max(step - b, 0.0) for n, b in busy.items()})


def _pipelined(
    placement: str,
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
    overlap with the consumer, collocated or not). The pipeline: its slowest rank's micro-batches,
    the schedule's bubble, the stage boundaries' sends and the hand-off both ways per micro-batch."""
    c = per[consumer]
    lm = n_mb * (c["fwd_s"] + c["bwd_s"] + 2 * handoff) + c["pp_bubble_s"] + c["pp_p2p_s"]
    enc = {p: n_mb * (per[p]["fwd_s"] + per[p]["bwd_s"]) for p in producers}
    serial = sum(enc.values()) if placement == "collocated" else max(enc.values(), default=0.0)
    finish = sum(fin.values()) if placement == "collocated" else max(fin.values())
    step = serial + lm + finish
    busy = {**{p: enc[p] + fin[p] for p in producers}, consumer: lm + fin[consumer]}
    idle = (
        {n: max(step - b, 0.0) for n, b in busy.items()}
        if placement != "collocated"
        else {n: 0.0 for n in busy}
    )
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
