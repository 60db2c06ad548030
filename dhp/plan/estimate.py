"""The step-time estimate of a compiled plan (formulas in ``dhp/plan/timing.py``).

Every module phase time is a dot product of FEATURES (seconds at efficiency 1: matmul, attention,
communication, memory traffic, and a count of calls) with the profile's inverse efficiencies and
its per-call overhead. ``dhp calibrate`` fits those coefficients by least squares over measured
runs, using the same features, so the plan and the fit can never disagree on a formula.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from dhp.plan.graph import ModuleGraph, run_graph
from dhp.plan.memory import ModuleShape, sp_rank_tokens
from dhp.plan.overheads import phase_counts
from dhp.plan.params import video_frames_per_row
from dhp.plan.pipeline import bubble_fraction, p2p_seconds, rank_shapes
from dhp.plan.schedule import StepEstimate, micro_batches_per_step, schedule
from dhp.plan.timing import (
    ATTN_BWD_FACTOR,
    ATTN_HALF_SPAN,
    grad_sync_s,
    link_of,
    module_comm,
    module_flops,
    optimizer_s,
    palm_model_flops,
)
from dhp.plan.types import Plan

FEATURES = (
    "matmul",
    "attention",
    "comm",
    "memory",
    "calls",
    "dispatch",
    "blocks",
    "dtensor_blocks",
    "fsdp_blocks",
    "attention_calls",
    "collectives",
    "tensors",
)
#: the per-call counts of dhp/plan/overheads.py and the profile key of each one's seconds per call
OVERHEAD_KEYS = {
    "blocks": "block_overhead_s",
    "dtensor_blocks": "dtensor_block_overhead_s",
    "fsdp_blocks": "fsdp_block_overhead_s",
    "attention_calls": "attention_call_overhead_s",
    "collectives": "collective_overhead_s",
    "tensors": "tensor_overhead_s",
}


@dataclass(frozen=True)
class ModuleFeatures:
    """Per micro-batch fwd/bwd and per step optimizer features of one module's rank."""

    fwd: dict[str, float]
    bwd: dict[str, float]
    step: dict[str, float]  # grad sync + optimizer (once per step)
    recompute_flops: float
    flops: float  # per rank and micro-batch, fwd + bwd
    a2a: float = 0.0  # seconds at efficiency 1 of the EP all-to-alls (inside fwd/bwd comm), per micro-batch


def coefficients(cluster: DictConfig) -> dict[str, float]:
    """Seconds per feature-second: inverse efficiencies, and the per-call overhead."""
    return {
        "matmul": 1.0 / cluster.matmul_efficiency,
        "attention": 1.0 / cluster.attention_efficiency,
        "comm": 1.0 / cluster.comm_efficiency,
        "memory": 1.0 / cluster.memory_efficiency,
        "calls": cluster.call_overhead_s,
        "dispatch": cluster.dispatch_overhead_s,
        **{k: float(cluster[key]) for k, key in OVERHEAD_KEYS.items()},
    }


def seconds(features: dict[str, float], coef: dict[str, float]) -> float:
    """Feature-seconds times coefficients; a feature a row does not have counts 0."""
    return sum(features.get(k, 0.0) * coef[k] for k in FEATURES)


def data_lengths(config: DictConfig) -> DictConfig | None:
    """The real data's measured per-row lengths (``data.lengths``, written by the CLI from a sample
    of the data: ``dhp.data.lengths``), or None: synthetic data, or lengths not measured."""
    if config.data.kind == "synthetic" or config.data.lengths.rows <= 0:
        return None
    return config.data.lengths


def expected_longest(lengths: list[int], k: int) -> float:
    """The expected longest of ``k`` rows drawn without replacement from ``lengths`` (the loader
    right-pads a micro-batch's LLM rows to its longest sample): sum over the sorted rows of
    x_(i) * C(i-1, k-1) / C(n, k); the longest row when ``k`` >= n."""
    xs, n = sorted(lengths), len(lengths)
    if k >= n:
        return float(xs[-1])
    total = math.comb(n, k)
    return sum(x * math.comb(i, k - 1) for i, x in enumerate(xs)) / total


def timing_shapes(
    config: DictConfig, shapes: dict[str, ModuleShape], *, micro_batch: int | None = None
) -> dict[str, ModuleShape]:
    """The shapes the step time is computed on. With the data's measured lengths: the LLM's rows
    padded to the expected longest sample of a micro-batch (packed: the micro-batch's tokens in as
    few rows of ``data.max_tokens`` as they fill), and the encoder's full-attention span the data's
    mean patches per image or video; else ``shapes`` (micro-batches filled to ``seq_len``, as
    memory keeps them: memory is never planned on a sample's lengths). ``micro_batch``: samples per
    micro-batch (default ``train.micro_batch_size``; the ``--auto`` search tries others)."""
    lengths = data_lengths(config)
    if lengths is None:
        return shapes
    out = dict(shapes)
    mb = int(config.train.micro_batch_size if micro_batch is None else micro_batch)
    graph = run_graph(config)
    if graph.consumer in out:
        loss = out[graph.consumer]
        if config.data.packing:  # shape: micro_batch = the row bound, seq_len = the row length
            need = mb * sum(lengths.tokens) / len(lengths.tokens)
            rows = min(loss.micro_batch, max(1, math.ceil(need / loss.seq_len)))
            out[graph.consumer] = dataclasses.replace(
                loss, micro_batch=rows, seq_len=min(loss.seq_len, math.ceil(need / rows))
            )
        else:
            row = min(loss.seq_len, math.ceil(expected_longest(list(lengths.tokens), mb)))
            out[graph.consumer] = dataclasses.replace(loss, seq_len=max(1, row))
    for name in _pixel_producers(graph, out) if lengths.media > 0 else []:
        out[name] = dataclasses.replace(out[name], image_patches=round(sum(lengths.patches) / lengths.media))
    return out


def _pixel_producers(graph: ModuleGraph, shapes: dict[str, ModuleShape]) -> list[str]:
    """The producers among ``shapes`` that read patch rows (image and video encoders)."""
    return [p for p in graph.producers if p in shapes and shapes[p].pixels]


def lengths_note(config: DictConfig, shapes: dict[str, ModuleShape]) -> str:
    """How the estimate's micro-batches were sized, for the estimate line (empty for synthetic
    data, whose sizes are configured). ``shapes``: :func:`timing_shapes`' result."""
    if config.data.kind == "synthetic":
        return ""
    lengths = data_lengths(config)
    if lengths is None:
        why = config.data.lengths.note or "not measured"
        return f"micro-batches filled to seq_len (data lengths: {why})"
    toks, patches = sorted(lengths.tokens), sorted(lengths.patches)
    graph = run_graph(config)
    pixel = _pixel_producers(graph, shapes)
    parts = [f"median {toks[(len(toks) - 1) // 2]} tokens"]
    if pixel:
        parts.append(f"{patches[(len(patches) - 1) // 2]} patches per row")
    c = shapes.get(graph.consumer)
    timed = [f"LLM {c.micro_batch} x {c.seq_len} tokens"] if c is not None else []
    for name in pixel:
        patch = producer_patches_per_replica(
            config,
            seq_len=shapes[name].seq_len,
            micro_batch=config.train.micro_batch_size,
            consumer_replicas=shapes[graph.consumer].layout.num_replicas,
            producer_replicas=shapes[name].layout.num_replicas,
        )
        timed.append(f"{patch:.0f} patches")
    return (
        f"step time from the data's lengths: {', '.join(parts)}, {lengths.rows} rows sampled of "
        f"{lengths.of_rows}; a micro-batch timed at {', '.join(timed)}; memory at the seq_len bound"
    )


def producer_tokens_per_rank(config: DictConfig, shape: ModuleShape, *, consumer_replicas: int) -> float:
    """Tokens one rank of a producer (of ``shape``'s layout) encodes per driver micro-batch, the
    consumer having ``consumer_replicas`` data replicas. A pixel producer (an image/video encoder):
    its patches, the real share when the data is synthetic (known patches per sample) or its lengths
    were measured (``data_lengths``), else the replica's capacity (``shape``'s ``seq_len``:
    ``dhp.plan.memory.encoder_replica_patches``), for its fullest SP rank. Any other producer: its
    bound, ``micro_batch x seq_len`` (``ModuleShape.tokens``: its ``seq_len`` counts one sample's)."""
    if not shape.pixels:
        return shape.tokens
    total = producer_patches_per_replica(
        config,
        seq_len=shape.seq_len,
        micro_batch=config.train.micro_batch_size,
        consumer_replicas=consumer_replicas,
        producer_replicas=shape.layout.num_replicas,
    )
    return sp_rank_tokens(shape.arch, total, shape.layout.sp, shape.image_patches)


def producer_patches_per_replica(
    config: DictConfig, *, seq_len: int, micro_batch: int, consumer_replicas: int, producer_replicas: int
) -> float:
    """Patches one pixel producer's replica encodes per driver micro-batch: its share of the consumer
    replicas' samples when the data is synthetic (images and videos of known size) or measured (the
    sampled rows' mean patches), else its capacity ``seq_len`` (the replica's:
    ``dhp.plan.memory.encoder_replica_patches``, which also caps the share). The estimate and the
    ``--auto`` search both time the encoder with this."""
    if config.data.kind != "synthetic":
        lengths = data_lengths(config)
        if lengths is None:
            return float(seq_len)
        per_row = sum(lengths.patches) / len(lengths.patches)
        return min(float(seq_len), consumer_replicas * micro_batch * per_row / producer_replicas)
    syn, temporal = config.data.synthetic, video_frames_per_row(config.model)
    video = syn.videos_per_sample * (syn.video_frames // temporal) * syn.patches
    per_sample = syn.patches * syn.images_per_sample + video
    return min(float(seq_len), consumer_replicas * micro_batch * per_sample / producer_replicas)


def vision_patches_per_replica(
    config: DictConfig, *, seq_len: int, micro_batch: int, llm_replicas: int, vision_replicas: int
) -> float:
    """:func:`producer_patches_per_replica` under its former keywords (kept for its callers outside
    the planner, which name the two modules of a VLM)."""
    return producer_patches_per_replica(
        config,
        seq_len=seq_len,
        micro_batch=micro_batch,
        consumer_replicas=llm_replicas,
        producer_replicas=vision_replicas,
    )


def oversubscription(cluster: DictConfig, processes: float) -> float:
    """How much slower each rank runs when ``processes`` rank processes time-share
    ``cluster.host_cores`` cores (CPU clusters; 1 on GPUs, where host_cores is 0)."""
    cores = cluster.host_cores
    return max(1.0, processes / cores) if cores > 0 and processes > 0 else 1.0


#: the driver: one more process on the host's cores while a step runs (routing, Ray calls)
DRIVER_PROCESSES = 1.0


def busy_processes(total: int) -> float:
    """Processes sharing a CPU host's cores while any rank of a plan with ``total`` rank processes
    runs, for ``oversubscription``: all of them, and the driver. An idle rank is not free on a CPU
    host (its Ray core worker and gloo threads keep waking), which the planner bench measures: a 1:1
    disaggregated plan's phases with one micro-batch take ~75% of two micro-batches' at half the
    size, where counting only the ranks at work predicted ~55%, and the held-out plans' step
    times come out within 25% in 31 of 32 predictions (4 bench runs, both calibration halves), 28
    of 32 counting only them."""
    return float(total) + DRIVER_PROCESSES


def module_features(
    shape: ModuleShape,
    tokens: float,
    cluster: DictConfig,
    world: int,
    processes: float = 0.0,
) -> ModuleFeatures:
    """Features of one rank of ``shape``'s module when its layers see ``tokens`` tokens;
    ``processes``: processes sharing the host's cores (``busy_processes``, for
    ``oversubscription``; GPUs never stretch)."""
    slow = oversubscription(cluster, processes)
    peak = cluster.peak_bf16_tflops * 1e12
    fl = module_flops(shape, tokens)
    h, m, tp = shape.layer.hidden, shape.layer.mlp, shape.layout.tp
    g = 2.0 * tokens * h * m / tp
    # no tokens (a text-only step's encoder): zero matmul FLOPs at any rate, never 0 / 0
    mm_rate = peak * g / (g + cluster.gemm_half_flops) if g > 0 else peak
    at_rate = peak * fl.attn_span / (fl.attn_span + ATTN_HALF_SPAN)
    lin_rate = peak * fl.linear_span / (fl.linear_span + ATTN_HALF_SPAN)  # the delta rule's C-wide tiles
    keys = ("intra_node_gbps", "inter_node_gbps", "gpus_per_node", "latency_us")
    link = link_of(OmegaConf.create({**{k: cluster[k] for k in keys}, "comm_efficiency": 1.0}))
    comm = module_comm(shape, tokens, link)
    fwd_mm = fl.matmul_fwd / mm_rate
    fwd_at = fl.attn_fwd / at_rate + fl.linear_fwd / lin_rate
    bwd_mm = (2 * fl.matmul_fwd + fl.recompute_matmul) / mm_rate if shape.backward else 0.0
    bwd_at = (
        (ATTN_BWD_FACTOR * fl.attn_fwd + fl.recompute_attn) / at_rate
        + (ATTN_BWD_FACTOR * fl.linear_fwd + fl.recompute_linear) / lin_rate
        if shape.backward
        else 0.0
    )
    # FSDP prefetch hides its collectives behind compute except the first block's, where a
    # separate engine moves the bytes (NCCL on a GPU); gloo on a CPU runs them on the same cores.
    # The compute that hides them is the achieved one (at the profile's efficiencies), not peak's:
    # torchtitan's 64-GPU A100 FSDP runs (scripts/check_public_anchors.py) hide all-gathers longer
    # than their compute at peak
    if cluster.device == "cuda":
        achieved = (fwd_mm + bwd_mm) / cluster.matmul_efficiency + (
            fwd_at + bwd_at
        ) / cluster.attention_efficiency
        fsdp = max(comm["fsdp"] - achieved * cluster.comm_efficiency, comm["fsdp"] / shape.layer.layers)
    else:
        fsdp = comm["fsdp"]
    raw_mem = OmegaConf.create({"hbm_gbps": cluster.hbm_gbps, "memory_efficiency": 1.0})
    counts = phase_counts(shape, tokens)
    feats = ModuleFeatures(
        fwd={
            "matmul": fwd_mm,
            "attention": fwd_at,
            "comm": comm["fwd"] + fsdp / 2,
            "memory": 0.0,
            "calls": 1.0,
            **counts["fwd"],
        },
        bwd={
            "matmul": bwd_mm,
            "attention": bwd_at,
            "comm": comm["bwd"] + fsdp / 2 if shape.backward else 0.0,
            "memory": 0.0,
            "calls": 1.0 if shape.backward else 0.0,
            **counts["bwd"],
        },
        step={
            "matmul": 0.0,
            "attention": 0.0,
            "comm": grad_sync_s(shape, link, world),
            "memory": optimizer_s(shape, raw_mem),
            "calls": 1.0,
            **counts["step"],
        },
        recompute_flops=fl.recompute_matmul + fl.recompute_attn + fl.recompute_linear,
        flops=fl.fwd + (fl.bwd if shape.backward else 0.0),
        a2a=comm["a2a"],
    )
    if slow == 1.0:
        return feats
    scale = lambda d: {k: v * slow for k, v in d.items()}  # noqa: E731
    return ModuleFeatures(
        scale(feats.fwd),
        scale(feats.bwd),
        scale(feats.step),
        feats.recompute_flops,
        feats.flops,
        feats.a2a * slow,
    )


def handoff_s(
    config: DictConfig, plan: Plan, shape: ModuleShape, tokens: float, cluster: DictConfig
) -> float:
    """One hand-off (or hand-back) of a micro-batch's merged embeddings, vision rank -> LLM."""
    span = len({r.global_gpu for g in plan.groups for r in g.ranks})
    return handoff_seconds(shape, tokens, cluster, handoff=plan.handoff, span=span)


def handoff_seconds(
    shape: ModuleShape, tokens: float, cluster: DictConfig, *, handoff: str, span: int
) -> float:
    """One hand-off of ``tokens`` encoder patches' merged embeddings (every edge's columns) over the
    resolved ``handoff`` (``cuda_ipc``: a copy in device memory; else the link across ``span`` GPUs)."""
    width = shape.handoff_width or shape.out_hidden  # every edge's columns (DeepStack: 1 + levels)
    nbytes = tokens / shape.arch.merge * width * shape.precision.act
    if handoff == "cuda_ipc":
        return nbytes / (cluster.hbm_gbps * 1e9 * cluster.memory_efficiency)
    link = link_of(cluster)
    return nbytes / link.bw(span) + link.lat


def module_time(f: ModuleFeatures, coef: dict[str, float], *, n_mb: int) -> dict[str, float]:
    """One module's time terms from its features: fwd_s / bwd_s per micro-batch, the step's
    collectives (comm_s), grad sync and optimizer per step, and the FLOPs of ``n_mb`` micro-batches.
    The one assembly the estimate and the ``--auto`` search both rank with."""
    return {
        "fwd_s": seconds(f.fwd, coef),
        "bwd_s": seconds(f.bwd, coef),
        "comm_s": n_mb * (f.fwd["comm"] + f.bwd["comm"]) * coef["comm"] + f.step["comm"] * coef["comm"],
        "grad_sync_s": f.step["comm"] * coef["comm"],
        "optim_s": seconds({**f.step, "comm": 0.0}, coef),
        "recompute_flops": n_mb * f.recompute_flops,
        "flops_per_rank": n_mb * f.flops,
        "a2a_s": n_mb * f.a2a * coef["comm"],  # part of comm_s: the EP all-to-alls of the step
    }


def pipeline_time(
    shape: ModuleShape,
    tokens: float,
    cluster: DictConfig,
    world: int,
    processes: float,
    coef: dict[str, float],
    *,
    n_mb: int,
) -> dict[str, float]:
    """:func:`module_time` of a module, and with pipeline stages (``dhp.plan.pipeline``) that of its
    slowest pipeline rank (its own layers' compute and collectives; the slowest grad sync and
    optimizer of any rank) plus ``pp_bubble_s`` (the schedule's idle share of the slowest rank's
    micro-batches) and ``pp_p2p_s`` (the stage boundaries' sends on the critical path)."""
    if shape.layout.pp <= 1:
        return module_time(module_features(shape, tokens, cluster, world, processes), coef, n_mb=n_mb)
    ranks = [
        module_time(module_features(r, r.tokens, cluster, world, processes), coef, n_mb=n_mb)
        for r in rank_shapes(shape)
    ]
    out = dict(max(ranks, key=lambda t: t["fwd_s"] + t["bwd_s"]))
    for key in ("grad_sync_s", "optim_s"):
        out[key] = max(t[key] for t in ranks)
    work = n_mb * (out["fwd_s"] + out["bwd_s"])
    out["pp_bubble_s"] = bubble_fraction(shape.layout, micro_batches=n_mb) * work
    out["pp_p2p_s"] = p2p_seconds(shape, link_of(cluster), micro_batches=n_mb)
    return out


def estimate_step(
    config: DictConfig, plan: Plan, shapes: dict[str, ModuleShape], *, cluster: DictConfig
) -> StepEstimate:
    """The step time, throughput and per-module breakdown of ``plan`` under ``cluster``'s profile."""
    graph = run_graph(config)
    replicas = plan.group(graph.consumer).layout.num_replicas
    n_mb = micro_batches_per_step(config.train, replicas)
    coef = coefficients(cluster)
    per: dict[str, dict[str, float]] = {}
    hand = 0.0
    shapes = timing_shapes(config, shapes)
    for name, shape in shapes.items():
        world = plan.group(name).world_size
        producer = name in graph.producers
        tokens = (
            producer_tokens_per_rank(config, shape, consumer_replicas=replicas) if producer else shape.tokens
        )
        procs = busy_processes(sum(g.world_size for g in plan.groups))
        per[name] = pipeline_time(shape, tokens, cluster, world, procs, coef, n_mb=n_mb)
        if producer:  # the consumer receives every producer's rows
            hand += handoff_s(config, plan, shape, tokens * shape.layout.sp, cluster)
    step = schedule(
        plan.placement, per, graph=graph, n_mb=n_mb, handoff=hand, dispatch=cluster.dispatch_overhead_s
    )
    lengths = data_lengths(config)
    gbs = int(config.train.global_batch_size)
    seqs = [config.modules[graph.consumer].seq_len] * gbs
    if lengths is not None:  # the sampled rows, cycled over the step's samples
        seqs = [int(lengths.tokens[i % lengths.rows]) for i in range(gbs)]
    text = float(sum(seqs))
    images: list[int] = []
    pixel = _pixel_producers(graph, shapes)
    if pixel:
        if lengths is not None:  # the sampled rows' images and videos, at their mean size
            per_item = round(sum(lengths.patches) / lengths.media) if lengths.media else 0
            images = [per_item] * (round(lengths.media * gbs / lengths.rows) if per_item else 0)
        elif config.data.kind == "synthetic":
            syn = config.data.synthetic
            images = [syn.patches] * (syn.images_per_sample * config.train.global_batch_size)
            if syn.videos_per_sample:  # video items: t x patches each
                video_item = syn.patches * (syn.video_frames // video_frames_per_row(config.model))
                images += [video_item] * (syn.videos_per_sample * config.train.global_batch_size)
        else:
            for name in pixel:
                images += [shapes[name].seq_len] * (n_mb * shapes[name].layout.num_replicas)
    patches = float(sum(images))
    model_flops = palm_model_flops(config, images, seqs)
    devices = len({r.global_gpu for g in plan.groups for r in g.ranks})
    return StepEstimate(
        step_time_s=step.step_s,
        vision_tokens_per_s=patches / step.step_s,
        text_tokens_per_s=text / step.step_s,
        mfu=model_flops / step.step_s / (cluster.peak_bf16_tflops * 1e12 * devices),
        micro_batches=n_mb,
        handoff_s=hand,
        bottleneck=step.bottleneck,
        idle_s=step.idle_s,
        profile=str(cluster.profile),
        modules=per,
        provenance="; ".join(p for p in (str(cluster.provenance), lengths_note(config, shapes)) if p),
    )
