"""A sub-second probe of this machine, per rank process: matmul rate, memory bandwidth, all-reduce.

Each is measured as a dhp rank runs: one thread (the workers run ``torch.set_num_threads(1)``),
fp32, and a gloo all-reduce between two ranks over loopback (two threads of this process, each
with its own ``ProcessGroupGloo`` on an in-process store). Nothing is kept in memory afterwards
(the largest buffer is a 32 MiB copy source and its target).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

#: matrix side of the matmul probe: a block-sized GEMM of the tiny and small models (~0.1 GFLOP)
MATMUL_N = 384
#: floats in the memory-bandwidth probe (32 MiB: beyond the caches)
COPY_NUMEL = 8 << 20
#: floats in the bandwidth part of the all-reduce probe (4 MiB)
ALLREDUCE_NUMEL = 1 << 20


@dataclass(frozen=True)
class Probe:
    """One probe's figures (per rank process)."""

    matmul_gflops: float  # fp32 GEMM rate of one thread
    copy_gbps: float  # bytes read + written per second by a tensor copy
    allreduce_latency_us: float  # a 1-float gloo all-reduce between 2 loopback ranks
    allreduce_gbps: float  # 4 MiB all-reduce: bytes per second per rank
    seconds: float  # how long the probe took

    def summary(self) -> str:
        return (
            f"matmul {self.matmul_gflops:.0f} GFLOP/s, copy {self.copy_gbps:.1f} GB/s, "
            f"all-reduce {self.allreduce_latency_us:.0f} us + {self.allreduce_gbps:.2f} GB/s"
        )


def _rate(fn, *, budget_s: float) -> float:
    """Calls of ``fn`` per second at its fastest call over about ``budget_s`` (after one untimed
    call): the machine's own rate. A box shared with other work slows some calls; the planner
    accounts for contention between dhp's own ranks itself (``host_cores``), so the probe must
    not count it too."""
    fn()
    best, t_end = float("inf"), time.perf_counter() + budget_s
    while True:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        best = min(best, t1 - t0)
        if t1 >= t_end:
            return 1.0 / best


def _allreduce(latency_iters: int = 20, bw_iters: int = 3) -> tuple[float, float]:
    import torch.distributed as dist  # torch loads only when the probe runs (dhp plan's other paths stay torch-free)

    store, out, errors = dist.HashStore(), {}, []

    def rank(r: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=20))
            small, big = torch.zeros(1), torch.zeros(ALLREDUCE_NUMEL)
            pg.allreduce([small]).wait()
            lat = big_s = float("inf")  # fastest of each: as _rate, contention is not the machine's
            for _ in range(latency_iters):
                t0 = time.perf_counter()
                pg.allreduce([small]).wait()
                lat = min(lat, time.perf_counter() - t0)
            pg.allreduce([big]).wait()
            for _ in range(bw_iters):
                t0 = time.perf_counter()
                pg.allreduce([big]).wait()
                big_s = min(big_s, time.perf_counter() - t0)
            out[r] = (lat, big_s)
        except Exception as e:  # surfaced by the caller, never swallowed
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    if errors or len(out) != 2:
        raise RuntimeError(f"the loopback all-reduce probe failed: {errors or 'a rank did not finish'}")
    lat = max(out[0][0], out[1][0])
    secs = max(out[0][1], out[1][1])
    return lat * 1e6, ALLREDUCE_NUMEL * 4 / secs / 1e9


def probe_machine() -> Probe:
    """Measure this machine as one rank process sees it (about 0.5 s)."""
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
        mm = 2.0 * MATMUL_N**3 * _rate(lambda: a @ b, budget_s=0.15) / 1e9
        x = torch.empty(COPY_NUMEL)
        y = torch.empty_like(x)
        copy = 2.0 * COPY_NUMEL * 4 * _rate(lambda: y.copy_(x), budget_s=0.1) / 1e9

        lat_us, ar_gbps = _allreduce()
    finally:
        torch.set_num_threads(threads)
    return Probe(mm, copy, lat_us, ar_gbps, time.perf_counter() - t0)
