"""The part of every rank actor that is not about a model: identity and its torch.distributed world."""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import socket
import tempfile
from dataclasses import dataclass

import ray
import torch
import torch.distributed as dist

from dhp.runtime.actors.dispatch import Collect, Dispatch, register
from dhp.runtime.actors.failures import FaultHook
from dhp.runtime.launch.devices import assigned_cuda_index
from dhp.runtime.launch.forklaunch import MISS_ENV
from dhp.runtime.launch.forkserver import FORKED_ENV


@dataclass(frozen=True)
class RankProcess:
    """Where one rank's actor runs: its pid, how its process began, its Ray node, and the descriptor
    of its stack file (``/proc/<pid>/fd/<stack_fd>``: what ``kill -USR1 <pid>`` writes)."""

    pid: int
    how: str
    node_id: str
    stack_fd: int


class DistWorker:
    """One rank of one actor group. Subclasses add model methods, each with a dispatch contract."""

    def __init__(self, *, module_name: str, rank: int, world_size: int) -> None:
        self.module_name = module_name
        self.rank = rank
        self.world_size = world_size
        torch.set_num_threads(1)
        # `kill -USR1 <pid>` writes every thread's Python stack into an unlinked file, read as
        # /proc/<pid>/fd/<n> (dhp.runtime.actors.stacks, on a hang); faulthandler writes it from the signal
        # handler itself, so it works while the rank's main thread holds the GIL in a collective
        self._stacks = tempfile.TemporaryFile()  # noqa: SIM115 (open for the process's life)
        faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)
        self.faults = FaultHook(module_name, rank)  # $DHP_INJECT_FAULT (tests only)

    def started(self) -> RankProcess:
        """This actor's process; ``how``: ``forked`` (from this node's pre-imported fork server,
        dhp.runtime.launch.forkserver), ``fresh`` (Ray's ordinary start), or ``fresh: REASON`` when a fork
        server was asked and could not serve."""
        miss = os.environ.get(MISS_ENV)
        how = f"fresh: {miss}" if miss else "fresh"
        if os.environ.get(FORKED_ENV) == str(os.getppid()):
            how = "forked"
        node = ray.get_runtime_context().get_node_id()
        return RankProcess(pid=os.getpid(), how=how, node_id=node, stack_fd=self._stacks.fileno())

    def pid(self) -> int:
        """This actor's OS process id (for failure messages and tests)."""
        return os.getpid()

    def master_addr_port(self) -> tuple[str, int]:
        """This node's IP and a free TCP port; called on rank 0 to rendezvous the group's world."""
        addr = _node_ip()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))  # probe on the node IP Ray gives, not every interface
            return addr, s.getsockname()[1]

    def init_dist(self, *, master_addr: str, master_port: int, backend: str, timeout_s: float) -> int:
        """Join this group's own default world. Blocks until every rank of the group joined."""
        if backend == "nccl":  # every GPU of the node is visible: pick Ray's (dhp.runtime.launch.devices)
            torch.cuda.set_device(assigned_cuda_index())
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        return dist.get_world_size()

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def all_reduce_sum(self, value: float) -> float:
        """Sum a float over the group (used by tests and health checks)."""
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    def destroy_dist(self) -> None:
        """Barrier, then destroy the world (a peer may abort if one side leaves early)."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _node_ip() -> str:
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # not inside Ray (unit tests that build a worker directly)
        return "127.0.0.1"
