"""Rank layout, GPU assignment, Ray bundles and N:M routing. Pure functions over plain data.

Ranks follow :class:`dhp.layout.ParallelLayout` (mesh axes dp, fsdp, sp, tp, outer -> inner), so a
data replica's ranks are contiguous and a TP group is a run of T consecutive ranks. GPUs are handed out in TP-sized chunks, and a chunk
always comes from one node. The placement's GPU-sharing sets (``dhp.config.placement``) decide who
shares:

- the modules of one set get the same GPUs (the set's widest-TP module's chunks, from the first
  node with enough free GPUs) and rank r of each sits on the same GPU, each with ``gpu_fraction =
  1 / sharers``: ``collocated`` is one set of every module;
- the sets take disjoint GPUs, one set after the other in the order written: ``disaggregated`` is a
  set per module in declaration order (``gpu_fraction = 1``); ``a+b/c`` gives a and b the first
  GPUs together and c the next ones.

Ray: one placement group per node used, strategy STRICT_PACK, one bundle per GPU. A bundle is
``{"GPU": 1, "CPU": cpus_per_rank * sharers}`` on CUDA clusters and
``{"CPU": cpus_per_rank * sharers}`` on CPU clusters, where sharers = groups on that GPU. Since a
TP group's GPUs are on one planned node, and a node's bundles are strictly packed, a TP group
never spans two machines.
"""

from __future__ import annotations

from collections.abc import Mapping

from dhp.config.placement import sharing_sets
from dhp.errors import PlanError
from dhp.layout import ParallelLayout
from dhp.plan.types import PlacementGroupSpec, Route


def _take_chunk(free: list[list[int]], size: int, *, group: str, gpus_per_node: int) -> list[int]:
    for node, gpus in enumerate(free):
        if len(gpus) >= size:
            taken, free[node] = gpus[:size], gpus[size:]
            return [node * gpus_per_node + g for g in taken]
    free_now = {n: len(g) for n, g in enumerate(free)}
    raise PlanError(
        f"group '{group}': no node has {size} free GPUs for a TP group (free GPUs per node: "
        f"{free_now}); a TP group must stay inside one node. Fix: use fewer GPUs, a smaller tp, "
        "or a cluster with more nodes"
    )


def assign_gpus(
    groups: Mapping[str, ParallelLayout], *, placement: str, nodes: int, gpus_per_node: int
) -> dict[str, list[int]]:
    """Global GPU id of every rank of every group, ``groups`` in declaration order (see the module
    docstring for the rules); PlanError when the placement is not valid for the groups, a sharing
    set's groups differ in size, or a TP group finds no node with room."""
    free = [list(range(gpus_per_node)) for _ in range(nodes)]
    out: dict[str, list[int]] = {}
    sets = sharing_sets(placement, list(groups))
    for members in sets:
        widest_name = max(members, key=lambda n: groups[n].tp)
        widest = groups[widest_name]
        shared: list[int] = []
        for _ in range(widest.world_size // widest.tp):
            shared += _take_chunk(free, widest.tp, group=widest_name, gpus_per_node=gpus_per_node)
        for name in members:
            g = groups[name]
            if g.world_size != widest.world_size:
                what = (
                    "collocated groups"
                    if len(sets) == 1
                    else f"the groups of sharing set {'+'.join(members)}"
                )
                raise PlanError(
                    f"{what} differ in size: '{name}' has {g.world_size} ranks, "
                    f"'{widest_name}' has {widest.world_size}. Fix: equal gpus per module of a set"
                )
            out[name] = list(shared)
            _check_tp_in_node(name, g, shared, gpus_per_node)
    return {name: out[name] for name in groups}


def gpu_sharers(gpus: Mapping[str, list[int]]) -> dict[int, list[str]]:
    """The groups on each GPU, in declaration order (``gpu_fraction = 1 / len``; a bundle's CPUs)."""
    sharers: dict[int, list[str]] = {}
    for name, ids in gpus.items():
        for gpu in ids:
            sharers.setdefault(gpu, []).append(name)
    return sharers


def _check_tp_in_node(name: str, group: ParallelLayout, gpus: list[int], gpus_per_node: int) -> None:
    for start in range(0, len(gpus), group.tp):
        nodes = {gpu // gpus_per_node for gpu in gpus[start : start + group.tp]}
        if len(nodes) > 1:
            raise PlanError(
                f"group '{name}': TP group of ranks {start}..{start + group.tp - 1} would "
                f"span nodes {sorted(nodes)}. Fix: tp must divide gpus_per_node={gpus_per_node}"
            )


def placement_groups(
    gpu_sharers: dict[int, int], *, device: str, gpus_per_node: int, cpus_per_rank: float
) -> tuple[list[PlacementGroupSpec], dict[int, tuple[int, int]]]:
    """One STRICT_PACK placement group per node; returns the specs and gpu -> (pg, bundle)."""
    by_node: dict[int, list[int]] = {}
    for gpu in sorted(gpu_sharers):
        by_node.setdefault(gpu // gpus_per_node, []).append(gpu)
    specs: list[PlacementGroupSpec] = []
    where: dict[int, tuple[int, int]] = {}
    for pg_index, (node, gpus) in enumerate(sorted(by_node.items())):
        bundles = []
        for b_index, gpu in enumerate(gpus):
            cpu = round(cpus_per_rank * gpu_sharers[gpu], 6)
            bundles.append({"GPU": 1.0, "CPU": cpu} if device == "cuda" else {"CPU": cpu})
            where[gpu] = (pg_index, b_index)
        specs.append(
            PlacementGroupSpec(
                node=node, strategy="STRICT_PACK", bundles=tuple(bundles), global_gpus=tuple(gpus)
            )
        )
    return specs, where


def routing(producer: ParallelLayout, consumer: ParallelLayout, *, name: str = "") -> list[Route]:
    """N:M routing: which producer (encoder) ranks produce the rows of each consumer (loss module) replica.

    Replica ``j`` of the consumer (ranks ``j*R_c .. (j+1)*R_c - 1``) takes its samples' rows from
    producer replica ``j // (C/P)`` when the producer has fewer replicas (P <= C; one producer replica
    serves C/P consumer replicas in turn), or from producer replicas ``j*(P/C) .. (j+1)*(P/C) - 1``
    when it has more (each encodes a share of the micro-batch). Inside a producer replica the SP
    ranks each hold a slice of the tokens; every TP rank of the consumer replica needs all of them.
    ``name``: the producer's, carried on each route.
    """
    p_reps, c_reps = producer.num_replicas, consumer.num_replicas
    routes = []
    for j in range(c_reps):
        if p_reps <= c_reps:
            p_ids = (j // (c_reps // p_reps),)
        else:
            k = p_reps // c_reps
            p_ids = tuple(range(j * k, (j + 1) * k))
        p_ranks = tuple(r for i in p_ids for r in producer.replica_ranks(i))
        c_ranks = tuple(consumer.replica_ranks(j))
        routes.append(Route(name, j, c_ranks, p_ids, p_ranks))
    return routes
