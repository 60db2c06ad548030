"""ActorGroup on a real local Ray with real gloo worlds: placement, concurrent init, contracts, failures."""

import os
import signal
import time
from pathlib import Path

import pytest
import ray

from dhp.errors import PlanError, RuntimeFailure
from dhp.layout import ParallelLayout
from dhp.runtime.actors.actor_group import ActorGroup, GroupSpec, RankSlot, init_groups, release, reserve
from dhp.runtime.actors.base_worker import DistWorker
from dhp.runtime.actors.dispatch import Collect, Dispatch, register

pytestmark = pytest.mark.integration


class EchoWorker(DistWorker):
    @register(dispatch=Dispatch.SHARD_BY_DP, collect=Collect.DP_LEADERS)
    def replica_item(self, item):
        return (self.rank, item)

    @register(dispatch=Dispatch.PER_RANK, collect=Collect.ALL)
    def rank_item(self, item):
        return (self.rank, item)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def sleep(self, seconds):
        time.sleep(seconds)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def break_rank0(self, seconds):
        """Rank 0 raises at once; the others stay busy for ``seconds`` (as peers blocked in a collective)."""
        if self.rank == 0:
            raise ValueError("rank 0 broke")
        time.sleep(seconds)


def _group(name, mesh, cpus=0.25):
    """A group on its own placement group (one CPU bundle per rank); returns (group, pgs)."""
    n = 1
    for d in mesh.values():
        n *= d
    pgs = reserve([([{"CPU": cpus}] * n, "PACK")], timeout_s=30)
    layout = ParallelLayout.from_config(mesh)
    spec = GroupSpec(name=name, layout=layout, slots=tuple(RankSlot(0, r, num_cpus=cpus) for r in range(n)))
    return ActorGroup(spec, pgs=pgs, worker_cls=EchoWorker, worker_kwargs={}), pgs


@pytest.mark.slow
def test_two_groups_own_separate_worlds_and_follow_contracts(ray_local):
    (vision, pg_v), (llm, pg_l) = _group("vision", {"sp": 2}), _group("llm", {"dp": 2, "tp": 2})
    try:
        # concurrent init: each group blocks until all its ranks join; neither waits on the other
        init_groups([vision, llm], timeout_s=60)
        # each world sums only its own ranks: 2 ranks -> 2.0, 4 ranks -> 4.0
        assert vision.call(EchoWorker.all_reduce_sum, 1.0) == [2.0, 2.0]
        assert llm.call(EchoWorker.all_reduce_sum, 1.0) == [4.0] * 4
        assert llm.call(EchoWorker.replica_item, ["a", "b"]) == [(0, "a"), (2, "b")]
        assert llm.call(EchoWorker.rank_item, [10, 11, 12, 13]) == [(0, 10), (1, 11), (2, 12), (3, 13)]
        assert len(set(vision.pids + llm.pids)) == 6  # one process per rank
    finally:
        vision.shutdown()
        llm.shutdown()
        release(pg_v + pg_l)


@pytest.mark.slow
def test_unplaceable_group_fails_fast_with_plan_error(ray_local):
    t0 = time.monotonic()
    with pytest.raises(PlanError, match=r"cannot place the plan: .*total \{'CPU': 6.0\}.*Fix: "):
        reserve([([{"CPU": 3.0}] * 2, "STRICT_PACK")], timeout_s=3)
    assert ray.available_resources()["CPU"] == 4.0  # nothing left reserved
    assert time.monotonic() - t0 < 15


@pytest.mark.slow
def test_killed_actor_is_named_by_module_and_rank(ray_local):
    group, pgs = _group("vision", {"sp": 2})
    try:
        group.init_process_group(timeout_s=60)
        pending = group.submit(EchoWorker.sleep, 30)
        time.sleep(1.0)
        os.kill(group.pids[1], signal.SIGKILL)
        with pytest.raises(RuntimeFailure, match=r"module 'vision' rank 1 \(pid \d+\) died"):
            group.collect(pending, timeout_s=60)
    finally:
        group.shutdown(destroy_dist=False)
        release(pgs)


@pytest.mark.slow
def test_failed_rank_is_blamed_not_its_busy_peer(ray_local):
    # rank 1 is alive but busy past the blame grace (3 s) and its 2 s liveness probe: the failure
    # names rank 0 and its own error, not rank 1 as dead
    group, pgs = _group("llm", {"tp": 2})
    try:
        group.wait_started()
        with pytest.raises(RuntimeFailure) as err:
            group.collect(group.submit(EchoWorker.break_rank0, 12), timeout_s=60)
        assert "module 'llm' rank 0" in str(err.value) and "rank 0 broke" in str(err.value), err.value
        assert "died" not in str(err.value), err.value
    finally:
        group.shutdown(destroy_dist=False)
        release(pgs)


@pytest.mark.slow
def test_ranks_forked_from_the_fork_server_form_worlds_and_report_their_death(ray_local):
    """With a fork server serving this node, every rank is a child of it (torch already imported),
    joins its gloo world, and a SIGKILLed rank is still reported by module and rank."""
    from dhp.runtime.launch import forkserver

    own = forkserver.current() is None  # the shared Ray's fixture runs one already (conftest)
    server = forkserver.ForkServer.start() if own else forkserver.current()
    server.serving = True
    try:
        (vision, pg_v), (llm, pg_l) = _group("vision", {"sp": 2}), _group("llm", {"tp": 2})
        try:
            assert vision.starts == ["forked"] * 2 and llm.starts == ["forked"] * 2
            for pid in vision.pids + llm.pids:
                stat = Path(f"/proc/{pid}/stat").read_text()
                assert int(stat.rsplit(")", 1)[1].split()[1]) == server.proc.pid  # the parent pid
            init_groups([vision, llm], timeout_s=60)
            assert vision.call(EchoWorker.all_reduce_sum, 1.0) == [2.0, 2.0]
            assert llm.call(EchoWorker.all_reduce_sum, 2.0) == [4.0, 4.0]
            pending = llm.submit(EchoWorker.sleep, 30)
            time.sleep(1.0)
            os.kill(llm.pids[1], signal.SIGKILL)
            with pytest.raises(RuntimeFailure, match=r"module 'llm' rank 1 \(pid \d+\) died"):
                llm.collect(pending, timeout_s=60)
            # Ray's cleanup of the dead worker kills its process group: only that rank's own, so the
            # server and the ranks forked beside it (another module's) live on
            time.sleep(2.0)
            assert server.alive() and vision.call(EchoWorker.all_reduce_sum, 1.0) == [2.0, 2.0]
        finally:
            vision.shutdown()
            llm.shutdown(destroy_dist=False)
            release(pg_v + pg_l)
        # killed by the teardown too, the ranks leave the server serving: the next group forks again
        time.sleep(1.0)
        again, pg_a = _group("llm", {"tp": 2})
        try:
            assert server.alive() and again.starts == ["forked"] * 2
        finally:
            again.shutdown(destroy_dist=False)
            release(pg_a)
    finally:
        if own:
            server.close()
