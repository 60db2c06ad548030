"""Warm workers (``dhp.runtime.warm_pool``, on for the shared test Ray): a run that closes normally
parks its rank processes, and the next run with equal placement groups re-initialises them.

Observed directly, since equal losses alone could not show it: the reused ranks are the same
processes (pids), they start clean (a marker set on the worker and a parameter changed in place in
the first run are gone; the world is new and complete), a run with other placement groups gets new
processes while the parked ones wait on beside it (the cluster has room), a failed (non-graceful)
close parks nothing, and a reservation that does not fit beside the parked group removes it and
its processes. Losses of reused processes against the unsplit model are what
tests/integration/test_verify.py already checks, under the same pool.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch
from plans import ALL_ONE
from procs import alive

from dhp.config import load_config
from dhp.plan import compile_plan
from dhp.runtime import Trainer, warm_pool
from dhp.runtime.actor_group import release, reserve

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _on_each(trainer: Trainer, fn) -> dict[str, list]:
    """``fn(worker)`` on every rank of every group (inside the actor), collected per module."""
    return {
        name: ray.get([a.__ray_call__.remote(fn) for a in g.actors], timeout=120)
        for name, g in trainer.groups.items()
    }


def _dirty(worker) -> None:
    """What a run leaves in its process: an attribute, and a parameter changed in place."""
    worker._left_by_the_last_run = True
    with torch.no_grad():
        next(worker.module.parameters()).add_(1.0)


def _first_param_sum(worker) -> float:
    p = next(worker.module.parameters())
    return float((p.to_local() if hasattr(p, "to_local") else p).double().sum())


def _pids(trainer: Trainer) -> dict[str, list[int]]:
    return {n: list(g.pids) for n, g in trainer.groups.items()}


def _wait(cond, timeout_s: float = 20.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


def test_parked_processes_serve_the_next_equal_plan_clean_and_end_otherwise(ray_local):
    pool = warm_pool.pool()
    assert pool is not None  # the shared test Ray turns warm workers on
    warm_pool.drain()
    cfg = load_config("tiny_vlm", [])  # collocated: vision sp=2 and llm tp=2 on 2 bundles
    plan = compile_plan(cfg)

    first = Trainer(cfg, plan)
    try:
        pids = _pids(first)
        fresh = _on_each(first, _first_param_sum)
        _on_each(first, _dirty)
        assert _on_each(first, _first_param_sum) != fresh
    finally:
        first.close()
    assert pool.parked_actors() == 4 and all(alive(p) for ps in pids.values() for p in ps)

    reused_before = pool.reused
    second = Trainer(cfg, plan)
    try:
        assert _pids(second) == pids  # the same processes, each in the same bundle and group
        assert pool.reused == reused_before + 4 and pool.parked_actors() == 0
        assert _on_each(second, lambda w: hasattr(w, "_left_by_the_last_run")) == {
            "vision": [False] * 2,
            "llm": [False] * 2,
        }
        assert _on_each(second, _first_param_sum) == fresh  # built anew from train.seed
        for name, g in second.groups.items():  # a new, complete world per group
            assert g.call("all_reduce_sum", 1.0) == [2.0, 2.0], name
    finally:
        second.close()

    other_cfg = load_config("tiny_vlm", ALL_ONE)  # other placement groups: nothing to reuse
    third = Trainer(other_cfg, compile_plan(other_cfg))
    try:
        new = {p for ps in _pids(third).values() for p in ps}
        assert not new & {p for ps in pids.values() for p in ps}
    finally:
        third.close(graceful=False)  # a failed run parks nothing
    # the cluster had room for both, so the parked group of the first plan waits on for a later run
    assert pool.parked_actors() == 4 and all(alive(p) for ps in pids.values() for p in ps)
    assert _wait(lambda: not any(alive(p) for p in new))

    # a reservation that does not fit beside the parked group removes it (and its processes)
    total = ray.cluster_resources()["CPU"]
    big = reserve([([{"CPU": total - 0.5}], "PACK")], timeout_s=60)
    try:
        assert pool.parked_actors() == 0
        assert _wait(lambda: not any(alive(p) for ps in pids.values() for p in ps))
    finally:
        release(big)
    assert _wait(lambda: ray.available_resources().get("CPU", 0.0) == total)
