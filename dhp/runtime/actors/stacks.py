"""Every rank's Python stack while its call still runs: what a hang or a broken collective left each
rank doing, read before the groups are torn down (``<run_dir>/traceback.txt``, the console line).

Each rank's faulthandler writes all its threads' stacks into the rank's own unlinked stack file on
``SIGUSR1`` (``dhp.runtime.actors.base_worker``), from the signal handler itself: no GIL is needed, so a
rank blocked inside a collective answers. One Ray task per node (no CPU reserved, pinned to the
node) signals that node's ranks and reads their files through ``/proc/<pid>/fd/<n>``; the driver
waits for them at most ``timeout_s``. Nothing here touches placements or device memory.
"""

from __future__ import annotations

import inspect
import os
import re
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

if TYPE_CHECKING:
    from dhp.runtime.actors.actor_group import ActorGroup

#: the part of the step each worker method is (the console names it beside the method)
PHASES = {
    "produce": "the producer's forward, hand-off out",
    "consume": "the consumer's hand-off in, forward and backward",
    "backprop": "the producer's hand-back and backward",
    "finalize_grads": "the gradient sync",
    "optimizer_step": "the optimizer step",
    "take_stats": "the step's statistics",
    "zero_grads": "dropping a step's gradients",
    "save_checkpoint": "a checkpoint write",
    "save_checkpoint_async": "a checkpoint's staging",
    "checkpoint_write_status": "waiting for a checkpoint write",
    "load_checkpoint": "a checkpoint load",
    "build": "the module build",
    "init_dist": "torch.distributed init",
    "connect_channel": "the hand-off channel's connect",
    "destroy_dist": "torch.distributed teardown",
}

_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")


@dataclass(frozen=True)
class RankStack:
    """One rank's stacks: faulthandler's dump of every thread (or why there is none), the worker
    method its main thread is inside (None: idle, waiting for a call) and that thread's innermost
    frame (``path:line in function``)."""

    module: str
    rank: int
    pid: int
    text: str
    method: str | None = None
    where: str | None = None

    @property
    def title(self) -> str:
        """``module 'llm' rank 1 (pid 42): in finalize_grads (the gradient sync), at ...``."""
        who = f"module '{self.module}' rank {self.rank} (pid {self.pid})"
        if self.method is None:
            return f"{who}: idle (no call running)" if self.where else f"{who}: {self.text.strip()}"
        phase = PHASES.get(self.method)
        return f"{who}: in {self.method}{f' ({phase})' if phase else ''}, at {self.where}"


def read_stacks(groups: dict[str, ActorGroup], *, timeout_s: float = 30.0) -> list[RankStack]:
    """Every started rank's stacks, per group in rank order; a rank whose node does not answer in
    ``timeout_s`` gets a RankStack saying so (a dead rank: that its process is gone)."""
    by_node: dict[str, list[tuple[int, int]]] = {}
    for g in groups.values():
        for p in g.procs:
            by_node.setdefault(p.node_id, []).append((p.pid, p.stack_fd))
    dump = ray.remote(num_cpus=0)(_dump_node)
    refs = {
        node: dump.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(procs)
        for node, procs in by_node.items()
    }
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    texts: dict[int, str] = {}
    for node, ref in refs.items():
        try:
            texts.update(ray.get(ref, timeout=0) if ref in ready else {})
        except ray.exceptions.RayError as e:
            texts.update(
                {pid: f"(no stack: the task on node {node[:8]} failed: {e})" for pid, _ in by_node[node]}
            )
    out = []
    for name, g in groups.items():
        methods = _worker_methods(g.worker_cls)
        for rank, p in enumerate(g.procs):
            text = texts.get(p.pid, f"(no stack: its node did not answer in {timeout_s:.0f}s)")
            out.append(_parse(name, rank, p.pid, text, methods))
    return out


def stuck_lines(stacks: list[RankStack]) -> list[str]:
    """One line per rank that is inside a worker method (the idle ones are left out)."""
    return [s.title for s in stacks if s.method is not None]


def _dump_node(procs: list[tuple[int, int]], settle_s: float = 3.0) -> dict[int, str]:
    """On one node: SIGUSR1 to each ``(pid, stack fd)``, then what each wrote (until its file stops
    growing, at most ``settle_s``)."""
    out: dict[int, str] = {}
    start: dict[int, tuple[str, int]] = {}
    for pid, fd in procs:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            start[pid] = (path, os.stat(path).st_size)
            os.kill(pid, signal.SIGUSR1)
        except OSError as e:
            start.pop(pid, None)
            out[pid] = f"(no stack: process {pid} is gone or unreadable: {e.strerror or e})"
    deadline, last = time.monotonic() + settle_s, None
    while start and time.monotonic() < deadline:
        time.sleep(0.2)
        sizes = {pid: _size(path) for pid, (path, _) in start.items()}
        if sizes == last and all(sizes[pid] > n for pid, (_, n) in start.items()):
            break
        last = sizes
    for pid, (path, n) in start.items():
        try:
            with open(path, "rb") as f:
                f.seek(n)
                out[pid] = f.read().decode(errors="replace") or f"(no stack written in {settle_s:.0f}s)"
        except OSError as e:
            out[pid] = f"(no stack: {e.strerror or e})"
    return out


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def _worker_methods(cls: type) -> dict[str, str]:
    """``{public method name: basename of the file defining it}`` of a worker class."""
    out = {}
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if not name.startswith("_"):
            out[name] = os.path.basename(inspect.getfile(fn))
    return out


def _parse(module: str, rank: int, pid: int, text: str, methods: dict[str, str]) -> RankStack:
    """The thread running a worker method (innermost such frame) and its innermost frame."""
    threads: list[list[re.Match]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append([])
        elif threads and (m := _FRAME.match(line)):
            threads[-1].append(m)
    for frames in threads:
        for m in frames:  # most recent call first
            if methods.get(m["func"]) == os.path.basename(m["path"]):
                return RankStack(module, rank, pid, text, method=m["func"], where=_short(frames[0]))
    idle = next((_short(f[0]) for f in threads if f), None)
    return RankStack(module, rank, pid, text, where=idle)


def _short(m: re.Match) -> str:
    """``torch/distributed/distributed_c10d.py:5140 in all_to_all_single`` (the last 3 path parts)."""
    return f"{'/'.join(m['path'].split('/')[-3:])}:{m['line']} in {m['func']}"
