"""The p2p hand-off bridge (``dhp.runtime.handoff.bridge``) between real processes over gloo.

Three processes stand for 2 vision ranks and 1 LLM rank, each with its own *default* world of
its own (as in the runtime), and join the bridge beside it. They run the pipelined order the
driver issues (vision: F0 F1 B0 F2 B1 B2; LLM: FB0 FB1 FB2) and check every received value.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.integration

VISION, LLM, STEPS = 2, 1, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(m: int, src: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(3, 2) + 100 * m + 10 * src


def _run(rank: int, ports: tuple[int, int, int], errors, done) -> None:
    from dhp.errors import RuntimeFailure
    from dhp.runtime.handoff.bridge import Bridge, BridgeLayout

    try:
        own, world_port = (rank, ports[0]) if rank < VISION else (rank - VISION, ports[1])
        size = VISION if rank < VISION else LLM
        dist.init_process_group(  # the rank's own group world, as every runtime worker has
            "gloo", init_method=f"tcp://127.0.0.1:{world_port}", rank=own, world_size=size
        )
        lay = BridgeLayout(groups=(("vision", VISION, 1), ("llm", LLM, 1)))
        module = "vision" if rank < VISION else "llm"
        assert lay.bridge_rank(module, own) == rank
        b = Bridge(
            host="127.0.0.1",
            port=ports[2],
            rank=rank,
            world_size=lay.world_size,
            backend="gloo",
            timeout_s=60,
        )
        cpu = torch.device("cpu")
        if module == "vision":
            order = ["F0", "F1", "B0", "F2", "B1", "B2"]
            for op in order:
                m = int(op[1])
                if op[0] == "F":
                    b.send(_rows(m, rank), dst=lay.endpoint("llm", 0), direction="fwd", tag=m)
                else:
                    g = b.recv(
                        (3, 2),
                        dtype=torch.float32,
                        device=cpu,
                        src=lay.endpoint("llm", 0),
                        direction="bwd",
                        tag=m,
                    )
                    assert torch.equal(g, -2 * _rows(m, rank)), (op, g)
        else:
            for m in range(STEPS):
                for src in range(VISION):  # sources in rank order, as the driver lists them
                    x = b.recv(
                        (3, 2),
                        dtype=torch.float32,
                        device=cpu,
                        src=lay.endpoint("vision", src),
                        direction="fwd",
                        tag=m,
                    )
                    assert torch.equal(x, _rows(m, src)), (m, src, x)
                    b.send(-2 * x, dst=src, direction="bwd", tag=m)
        b.drain()
        dist.all_reduce(torch.ones(1))  # the group's own world still works beside the bridge
        if module == "vision":  # a send nobody receives, then an aborted step: the bridge refuses reuse
            b.send(torch.ones(1), dst=lay.endpoint("llm", 0), direction="fwd", tag=99)
            b.abandon()
            try:
                b.send(torch.ones(1), dst=lay.endpoint("llm", 0), direction="fwd", tag=0)
                raise AssertionError("a stale bridge accepted a send")
            except RuntimeFailure as e:
                assert "aborted step" in str(e)
        # every rank stays up until the vision ranks' unreceived send is issued: a peer that has
        # already exited would close the connection under it
        done.wait(timeout=60)
        dist.destroy_process_group()
    except BaseException as e:  # report to the parent with the rank
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


@pytest.mark.slow
def test_pipelined_exchange_over_the_bridge() -> None:
    ctx = mp.get_context("spawn")
    errors, done = ctx.Queue(), ctx.Barrier(VISION + LLM)
    ports = (_free_port(), _free_port(), _free_port())
    procs = [ctx.Process(target=_run, args=(r, ports, errors, done)) for r in range(VISION + LLM)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not alive, f"ranks {alive} hung"
    assert not failures and all(p.exitcode == 0 for p in procs), (failures, [p.exitcode for p in procs])
