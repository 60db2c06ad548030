"""``compile_plan``: a validated RunConfig -> a Plan. Deterministic, pure, no Ray."""

from __future__ import annotations

from omegaconf import DictConfig

from dhp.config.constants import PARALLEL_AXES
from dhp.config.handoff import resolve_handoff
from dhp.plan.memory import estimate_module, module_shape, reserve_bytes
from dhp.plan.placement import GroupLayout, assign_gpus, placement_groups, routing
from dhp.plan.types import DeviceUsage, GroupPlan, MemoryEstimate, Plan, RankPlan

GIB = 1 << 30


def _layouts(modules: DictConfig) -> list[GroupLayout]:
    return [
        GroupLayout(name=str(name), degrees={a: int(mod.parallel[a]) for a in PARALLEL_AXES})
        for name, mod in modules.items()
    ]


def _group_plan(
    layout: GroupLayout,
    memory: MemoryEstimate,
    *,
    param_count: int,
    gpus: list[int],
    sharers: dict[int, list[str]],
    where: dict[int, tuple[int, int]],
    gpus_per_node: int,
) -> GroupPlan:
    """One group's ranks: node/GPU from ``gpus``, fraction from the sharers, bundle from ``where``."""
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
                memory=memory,
            )
        )
    return GroupPlan(
        name=layout.name,
        world_size=layout.world_size,
        mesh=layout.mesh(),
        param_count=param_count,
        ranks=tuple(ranks),
    )


def compile_plan(config: DictConfig, cluster: DictConfig | None = None) -> Plan:
    """Compile the plan of a validated run config (``load_config``'s result).

    ``cluster`` defaults to ``config.cluster``; pass another ClusterConfig to re-plan the same run
    on different hardware. Raises PlanError when the groups cannot be laid out.
    """
    cluster = config.cluster if cluster is None else cluster
    gpn = cluster.gpus_per_node
    layouts = _layouts(config.modules)
    gpus = assign_gpus(layouts, placement=config.placement, nodes=cluster.nodes, gpus_per_node=gpn)
    sharers: dict[int, list[str]] = {}
    for layout in layouts:
        for gpu in gpus[layout.name]:
            sharers.setdefault(gpu, []).append(layout.name)
    pgs, where = placement_groups(
        {g: len(n) for g, n in sharers.items()},
        device=cluster.device,
        gpus_per_node=gpn,
        cpus_per_rank=cluster.cpus_per_rank,
    )
    groups = []
    per_gpu: dict[int, int] = dict.fromkeys(sharers, 0)
    for layout in layouts:
        module = config.modules[layout.name]
        shape = module_shape(
            layout.name, model=config.model, module=module, micro_batch=config.train.micro_batch_size
        )
        memory = estimate_module(shape, model=config.model)
        groups.append(
            _group_plan(
                layout,
                memory,
                param_count=shape.params.total,
                gpus=gpus[layout.name],
                sharers=sharers,
                where=where,
                gpus_per_node=gpn,
            )
        )
        for gpu in gpus[layout.name]:
            per_gpu[gpu] += memory.total
    device_bytes = int(cluster.device_memory_gib * GIB)
    reserve = reserve_bytes(device_bytes)
    devices = tuple(
        DeviceUsage(
            global_gpu=g,
            node=g // gpn,
            gpu=g % gpn,
            groups=tuple(sharers[g]),
            total=per_gpu[g],
            budget=device_bytes - reserve,
        )
        for g in sorted(sharers)
    )
    by_name = {lay.name: lay for lay in layouts}
    routes = routing(by_name["vision"], by_name["llm"]) if {"vision", "llm"} <= by_name.keys() else []
    return Plan(
        name=config.name,
        placement=config.placement,
        device=cluster.device,
        device_memory_bytes=device_bytes,
        reserve_bytes=reserve,
        groups=tuple(groups),
        placement_groups=tuple(pgs),
        routing=tuple(routes),
        devices=devices,
        handoff=resolve_handoff(device=cluster.device, placement=config.placement, handoff=config.handoff)[0],
    )
