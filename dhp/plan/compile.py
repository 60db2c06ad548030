"""``compile_plan``: a validated RunConfig -> a Plan. Deterministic, pure, no Ray."""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig

from dhp.config.handoff import run_handoff
from dhp.config.placement import sharing_sets
from dhp.config.validate_data_keys import packed_row_tokens
from dhp.errors import PlanError
from dhp.layout import ParallelLayout, module_layout
from dhp.ops.linear_attn import planned_kernel
from dhp.plan.estimate import estimate_step
from dhp.plan.experts import linear_summary, moe_summary
from dhp.plan.graph import run_graph
from dhp.plan.memory import ModuleShape, encoder_replica_patches, module_shape
from dhp.plan.params import video_frames_per_row
from dhp.plan.phases import ModuleTerms, gpu_timeline, reserve_bytes
from dhp.plan.pipeline import ahead_of_pipeline, pipeline_terms, rank_shapes
from dhp.plan.placement import assign_gpus, gpu_sharers, placement_groups, routing
from dhp.plan.schedule import micro_batches_per_step  # re-exported (calibrate, scripts)
from dhp.plan.types import DeviceUsage, GroupPlan, MemoryEstimate, Plan, RankPlan
from dhp.plan.workload import plan_workload

GIB = 1 << 30


def module_layouts(config: DictConfig) -> dict[str, ParallelLayout]:
    """Every module's :class:`~dhp.layout.ParallelLayout`, in declaration order: built here once per
    compiled plan, then carried by it (``GroupPlan.layout``)."""
    return {str(name): module_layout(mod) for name, mod in config.modules.items()}


def _group_plan(
    name: str,
    layout: ParallelLayout,
    memory: list[MemoryEstimate],
    *,
    param_count: int,
    active_param_count: int,
    gpus: list[int],
    sharers: dict[int, list[str]],
    where: dict[int, tuple[int, int]],
    gpus_per_node: int,
    stage_layers: tuple[int, ...] = (),
) -> GroupPlan:
    """One group's ranks: node/GPU from ``gpus``, fraction from the sharers, bundle from ``where``;
    ``memory``: per pipeline rank (one entry without pipeline stages)."""
    ranks = []
    for rank, gpu in enumerate(gpus):
        pg, bundle = where[gpu]
        ranks.append(
            RankPlan(
                rank=rank,
                coords=layout.coords(rank),
                node=gpu // gpus_per_node,
                gpu=gpu % gpus_per_node,
                global_gpu=gpu,
                gpu_fraction=1.0 / len(sharers[gpu]),
                placement_group=pg,
                bundle_index=bundle,
                memory=memory[layout.pp_rank(rank)],
            )
        )
    return GroupPlan(
        name=name,
        layout=layout,
        param_count=param_count,
        active_param_count=active_param_count,
        ranks=tuple(ranks),
        stage_layers=stage_layers,
    )


def image_patches(config: DictConfig) -> int:
    """Patches of one image (the span of the encoder's full-attention blocks); 0 when unknown."""
    if config.data.kind == "synthetic":
        syn = config.data.synthetic
        if syn.videos_per_sample:  # a video is one item of t frames' patches
            return int(syn.patches) * max(1, int(syn.video_frames) // video_frames_per_row(config.model))
        return int(syn.patches)
    return 0


def module_shapes(
    config: DictConfig, layouts: dict[str, ParallelLayout] | None = None
) -> dict[str, ModuleShape]:
    """The ModuleShape of every module of ``config`` (what memory and time read) at ``layouts``
    (default: the config's, :func:`module_layouts`). An encoder's ``seq_len`` is what one of its
    replicas encodes per driver micro-batch (:func:`~dhp.plan.memory.encoder_replica_patches`), the
    loss module's (:func:`~dhp.plan.graph.run_graph`) rows are the packed rows when packing is on."""
    layouts = module_layouts(config) if layouts is None else layouts
    shapes = {
        str(name): module_shape(
            str(name),
            model=config.model,
            module=mod,
            layout=layouts[str(name)],
            micro_batch=config.train.micro_batch_size,
            image_patches=image_patches(config),
            device=config.cluster.device,
        )
        for name, mod in config.modules.items()
    }
    consumer = run_graph(config).consumer
    if consumer in shapes:  # an encoder replica encodes the images of every consumer replica it serves
        for name, shape in shapes.items():
            if shape.pixels:
                patches = encoder_replica_patches(
                    shape.seq_len, producer=layouts[name], consumer=layouts[consumer]
                )
                shapes[name] = dataclasses.replace(shape, seq_len=patches)
        shapes[consumer] = packed_rows(config, shapes[consumer])
    return shapes


def packed_rows(config: DictConfig, consumer: ModuleShape) -> ModuleShape:
    """The loss module's shape in packed rows when ``data.packing`` is on (else ``consumer``): rows of
    ``data.max_tokens`` (0: seq_len); first-fit never needs more rows than 2 * tokens / row + 1 (any
    two rows together overflow one), nor more than samples."""
    row, _ = packed_row_tokens(
        packing=config.data.packing, max_tokens=config.data.max_tokens, token_seq_len=int(consumer.seq_len)
    )  # validated already: the row holds the longest sample
    if not row:
        return consumer
    rows = min(consumer.micro_batch, (2 * consumer.micro_batch * consumer.seq_len) // row + 1)
    return dataclasses.replace(consumer, micro_batch=rows, seq_len=row)


def plan_handoff(config: DictConfig, *, cluster: DictConfig) -> str:
    """The hand-off transport of the run (``handoff=auto`` resolved per edge, ``dhp.config.handoff``):
    PlanError when its edges need different ones (validation reports it first)."""
    graph = run_graph(config)
    sets = sharing_sets(config.placement, [str(n) for n in config.modules])
    transport, problem = run_handoff(
        device=cluster.device, sets=sets, consumer=graph.consumer, handoff=config.handoff
    )
    if problem is not None:
        raise PlanError(f"handoff={config.handoff}: {problem}")
    return transport


def memory_estimate(terms: ModuleTerms, shape: ModuleShape, moe: dict | None = None) -> MemoryEstimate:
    """The per-rank MemoryEstimate of one module from its terms (its own timeline alone); ``moe``:
    its :func:`~dhp.plan.experts.moe_summary`."""
    alone = gpu_timeline([terms])
    pr = shape.precision
    mbs = 1 if terms.computes_loss else terms.live_micro_batches
    return MemoryEstimate(
        params=terms.params,
        grads=terms.grads,
        optimizer=terms.optimizer,
        activations=int(terms.saved_total * mbs * terms.in_flight),
        detail=dict(terms.saved),
        work={
            f"{terms.name}_fwd": dict(terms.fwd_work),
            f"{terms.name}_bwd": dict(terms.bwd_work),
            "handoff": {"payload": terms.handoff},
            "grad_sync": {"allreduce_buffer": terms.sync},
            "grad_norm": {"norm_squares": terms.norm},
            "optimizer": {"optimizer_temp": terms.optim},
        },
        phases=dict(alone.by_phase),
        peak_phase=alone.peak_phase,
        optimizer_impl=terms.optimizer_impl,
        bytes_per_param={
            "params": pr.param,
            "grads": pr.grad if terms.grads else 0,
            "optimizer": pr.optimizer if terms.optimizer else 0,
            "activations": pr.act,
        },
        loss_chunk_tokens=shape.loss_chunk_tokens,
        accounted_peak=terms.accounted_peak(),
        moe={k: v for k, v in (moe or {}).items() if k != "worst_terms"},
        linear=linear_summary(shape),
    )


def compile_plan(config: DictConfig, cluster: DictConfig | None = None, *, estimate: bool = True) -> Plan:
    """Compile the plan of a validated run config (``load_config``'s result).

    ``cluster`` defaults to ``config.cluster``; pass another ClusterConfig to re-plan the same run
    on different hardware. ``estimate=False`` skips the step-time model. Raises PlanError when the
    groups cannot be laid out.
    """
    cluster = config.cluster if cluster is None else cluster
    gpn = cluster.gpus_per_node
    layouts = module_layouts(config)
    gpus = assign_gpus(layouts, placement=config.placement, nodes=cluster.nodes, gpus_per_node=gpn)
    sharers = gpu_sharers(gpus)  # the modules whose timelines add up on each GPU
    pgs, where = placement_groups(
        {g: len(n) for g, n in sharers.items()},
        device=cluster.device,
        gpus_per_node=gpn,
        cpus_per_rank=cluster.cpus_per_rank,
    )
    shapes = module_shapes(config, layouts)
    graph = run_graph(config)
    n_mb = micro_batches_per_step(config.train, layouts[graph.consumer].num_replicas)
    impl = config.train.optimizer.impl
    # per pipeline rank (one entry per module without pipeline stages)
    stages = {
        n: [
            ahead_of_pipeline(t, layouts[graph.consumer], micro_batches=n_mb)
            for t in pipeline_terms(s, micro_batches=n_mb, optimizer_impl=impl)
        ]
        for n, s in shapes.items()
    }
    staged = {n: rank_shapes(s) for n, s in shapes.items()}
    terms = {n: t[0] for n, t in stages.items()}
    moe = {n: moe_summary(staged[n][0], terms[n], micro_batches=n_mb, optimizer_impl=impl) for n in shapes}
    groups = []
    for name, layout in layouts.items():
        groups.append(
            _group_plan(
                name,
                layout,
                [
                    memory_estimate(t, staged[name][t.stage], moe[name] if t.stage == 0 else None)
                    for t in stages[name]
                ],
                param_count=shapes[name].params.total,
                active_param_count=shapes[name].arch.active_params,
                gpus=gpus[name],
                sharers=sharers,
                where=where,
                gpus_per_node=gpn,
                stage_layers=tuple(hi - lo for lo, hi in layout.stage_ranges(shapes[name].arch.layers))
                if layout.pp > 1
                else (),
            )
        )
    device_bytes = int(cluster.device_memory_gib * GIB)
    devices = []

    def on(name: str, gpu: int) -> ModuleTerms:  # the pipeline rank of module ``name`` on ``gpu``
        return stages[name][layouts[name].pp_rank(gpus[name].index(gpu))]

    for g in sorted(sharers):
        line = gpu_timeline([on(n, g) for n in sharers[g]])
        reserve = reserve_bytes(device_bytes, processes=len(sharers[g]))
        worst = 0
        if any(moe[n] for n in sharers[g]):
            worst = gpu_timeline([moe[n]["worst_terms"] if moe[n] else on(n, g) for n in sharers[g]]).peak
        devices.append(
            DeviceUsage(
                global_gpu=g,
                node=g // gpn,
                gpu=g % gpn,
                groups=tuple(sharers[g]),
                total=line.peak,
                budget=device_bytes - reserve,
                peak_phase=line.peak_phase,
                peak_terms=line.peak_terms,
                by_phase=line.by_phase,
                reserve=reserve,
                worst_case_total=worst,
            )
        )
    # each producer's N:M routing into the consumer (the rows of every consumer replica)
    routes = [
        r
        for p in graph.producers
        if p in layouts and graph.consumer in layouts
        for r in routing(layouts[p], layouts[graph.consumer], name=p)
    ]
    plan = Plan(
        name=config.name,
        placement=config.placement,
        device=cluster.device,
        device_memory_bytes=device_bytes,
        reserve_bytes=max(d.reserve for d in devices),
        groups=tuple(groups),
        placement_groups=tuple(pgs),
        routing=tuple(routes),
        devices=tuple(devices),
        handoff=plan_handoff(config, cluster=cluster),
        loss_chunk_tokens={n: s.loss_chunk_tokens for n, s in shapes.items() if n == graph.consumer},
        # the kernel the plan counts on its device and needs there (the runtime checks it is
        # installed at start: dhp.ops.linear_attn.require_kernel; each run's metrics say what ran)
        kernels={
            n: planned_kernel(cluster.device)
            for n, s in shapes.items()
            if s.arch is not None and s.arch.count("linear")
        },
        workload=plan_workload(config, shapes, layouts),
    )
    if not estimate:
        return plan
    return dataclasses.replace(plan, estimate=estimate_step(config, plan, shapes, cluster=cluster).to_json())
