"""Rank layout, GPU assignment, Ray bundles and N:M routing. Pure functions over plain data.

Ranks follow :class:`dhp.layout.ParallelLayout` (mesh axes dp, fsdp, sp, tp, outer -> inner), so a
data replica's ranks are contiguous and a TP group is a run of T consecutive ranks. GPUs are handed out in TP-sized chunks, and a chunk
always comes from one node:

- collocated: every group gets the same GPUs (the first N of the cluster, node-major) and rank r
  of every group sits on the same GPU, each with ``gpu_fraction = 1 / groups``;
- disaggregated: groups take disjoint GPUs in declaration order (vision, then llm), each chunk
  from the first node with enough free GPUs, ``gpu_fraction = 1``.

Ray: one placement group per node used, strategy STRICT_PACK, one bundle per GPU. A bundle is
``{"GPU": 1, "CPU": cpus_per_rank * sharers}`` on CUDA clusters and
``{"CPU": cpus_per_rank * sharers}`` on CPU clusters, where sharers = groups on that GPU. Since a
TP group's GPUs are on one planned node, and a node's bundles are strictly packed, a TP group
never spans two machines.
"""

from __future__ import annotations

from collections.abc import Mapping

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
    docstring for the rules)."""
    free = [list(range(gpus_per_node)) for _ in range(nodes)]
    out: dict[str, list[int]] = {}
    if placement == "collocated":
        widest_name = max(groups, key=lambda n: groups[n].tp)
        widest = groups[widest_name]
        shared: list[int] = []
        for _ in range(widest.world_size // widest.tp):
            shared += _take_chunk(free, widest.tp, group=widest_name, gpus_per_node=gpus_per_node)
        for name, g in groups.items():
            if g.world_size != widest.world_size:
                raise PlanError(
                    f"collocated groups differ in size: '{name}' has {g.world_size} ranks, "
                    f"'{widest_name}' has {widest.world_size}. Fix: equal gpus per module"
                )
            out[name] = list(shared)
            _check_tp_in_node(name, g, shared, gpus_per_node)
        return out
    for name, g in groups.items():
        gpus: list[int] = []
        for _ in range(g.world_size // g.tp):
            gpus += _take_chunk(free, g.tp, group=name, gpus_per_node=gpus_per_node)
        out[name] = gpus
    return out


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


def routing(vision: ParallelLayout, llm: ParallelLayout) -> list[Route]:
    """N:M routing: which encoder ranks produce the image embeddings of each LLM replica.

    Replica ``j`` of the LLM (ranks ``j*R_l .. (j+1)*R_l - 1``) takes its samples' embeddings from
    encoder replica ``j // (L/V)`` when the encoder has fewer replicas (V <= L; one encoder replica
    serves L/V LLM replicas in turn), or from encoder replicas ``j*(V/L) .. (j+1)*(V/L) - 1`` when
    it has more (each encodes a share of the micro-batch). Inside an encoder replica the SP ranks
    each hold a slice of the tokens; every TP rank of the LLM replica needs all of them.
    """
    v_reps, l_reps = vision.num_replicas, llm.num_replicas
    routes = []
    for j in range(l_reps):
        if v_reps <= l_reps:
            v_ids = (j // (l_reps // v_reps),)
        else:
            k = v_reps // l_reps
            v_ids = tuple(range(j * k, (j + 1) * k))
        v_ranks = tuple(r for i in v_ids for r in vision.replica_ranks(i))
        l_ranks = tuple(llm.replica_ranks(j))
        routes.append(Route(llm_replica=j, llm_ranks=l_ranks, vision_replicas=v_ids, vision_ranks=v_ranks))
    return routes
