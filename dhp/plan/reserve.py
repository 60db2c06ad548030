"""Check a Plan against a live Ray cluster: reserve its placement groups, then release them.

This is the only module under ``dhp/plan`` that touches Ray, and it imports Ray lazily; the
planner itself (``dhp.plan``) stays pure. A plan that cannot be placed raises PlanError naming
the missing resources instead of waiting forever on ``pg.ready()``.
"""

from __future__ import annotations

from omegaconf import DictConfig

from dhp.errors import PlanError
from dhp.plan.types import Plan

DEFAULT_TIMEOUT_S = 30.0


def _missing(need: dict[str, float], have: dict[str, float]) -> dict[str, float]:
    return {k: round(v - have.get(k, 0.0), 6) for k, v in need.items() if v > have.get(k, 0.0) + 1e-9}


def reserve_plan(plan: Plan, *, cluster: DictConfig, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Reserve every placement group of ``plan`` on Ray (join ``cluster.ray_address`` or start a
    local Ray sized to the plan), wait up to ``timeout_s``, then remove them.

    Holds no GPU memory: bundles are only resources. Raises PlanError when a group cannot be placed.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from dhp.ray_connect import connect_ray

    # cluster.ray_address, $RAY_ADDRESS, or a fresh local instance: the same function as `dhp train`
    started = connect_ray(cluster=cluster, resources={"CPU": float(_local_cpus(plan))})
    try:
        have = ray.cluster_resources()
        need = plan.resources
        missing = _missing(need, have)
        if missing:
            raise PlanError(
                f"the Ray cluster cannot place plan '{plan.name}': it needs {need} but has "
                f"{ {k: have.get(k, 0.0) for k in need} }; missing {missing}. Fix: add nodes "
                "or GPUs, or pick the matching cluster profile (cluster=...)"
            )
        _reserve_all(plan, timeout_s, placement_group, remove_placement_group, ray)
    finally:
        if started:
            ray.shutdown()


def _local_cpus(plan: Plan) -> int:
    """A local Ray for CPU plans gets just enough CPU slots for the bundles (at least 1)."""
    need = plan.resources.get("CPU", 1.0)
    return max(1, int(-(-need // 1)))


def _reserve_all(plan: Plan, timeout_s: float, placement_group, remove_placement_group, ray) -> None:
    pgs = []
    try:
        for spec in plan.placement_groups:
            pgs.append(placement_group([dict(b) for b in spec.bundles], strategy=spec.strategy))
        for spec, pg in zip(plan.placement_groups, pgs, strict=True):
            ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
            if not ready:
                raise PlanError(
                    f"placement group for node {spec.node} ({len(spec.bundles)} bundles "
                    f"{spec.bundles[0]}, {spec.strategy}) was not placed within {timeout_s:.0f}s. "
                    f"Cluster resources: {ray.cluster_resources()}. Fix: a node with "
                    f"{len(spec.bundles)} free GPUs/CPU slots is needed"
                )
    finally:
        for pg in pgs:
            remove_placement_group(pg)
