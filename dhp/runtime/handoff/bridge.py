"""The ``p2p`` hand-off: point-to-point process groups that span the vision and LLM groups.

Every rank already owns its group's *default* torch.distributed world, so a cross-group
communicator cannot come from ``new_group`` (which needs a default world containing both sides),
nor from Ray's tensor transport (it initialises a default world of its own). The
bridge is built directly instead: one ``TCPStore`` hosted by vision rank 0, and two backends
(``ProcessGroupNCCL`` on cuda, ``ProcessGroupGloo`` on cpu) over prefixed views of it:

- ``fwd``: producer -> consumer (e.g. vision -> LLM), hand-off rows;
- ``bwd``: consumer -> producer, their gradients.

Two communicators, because NCCL runs a communicator's operations in issue order on one stream:
with one, the pipelined order (vision: send F1, then recv B0; LLM: send B0, then recv F1) would
deadlock. On each of the two, every rank issues its operations in the same global order
(micro-batch, then source, then destination), so none can wait on an operation issued later.

Bridge ranks: the groups' ranks one after the other (:class:`BridgeLayout`): vision rank ``r`` is
``r``, LLM rank ``q`` is ``V + q`` (``V`` = vision world size). Bytes: a row crosses the bridge once,
from its producer unit's leader (TP rank 0) to the consumer replica's leader, which broadcasts the
assembled rows inside its own replica; the gradient rows go back leader to unit leader, which
broadcasts them inside the producer's TP group. ``dhp.runtime.handoff.transport.BridgeTransport`` puts this
behind the same channel interface as the object store and CUDA IPC. Memory: the
sent tensors stay referenced until :meth:`Bridge.drain` (end of the step's backward), received ones
are fresh buffers owned by the caller.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dhp.errors import RuntimeFailure

DIRECTIONS = ("fwd", "bwd")


@dataclass(frozen=True)
class BridgeLayout:
    """Where each group's senders and receivers sit in bridge ranks (pure arithmetic).

    ``groups``: ``(module, world_size, endpoint_stride)`` in bridge order (producers first). Group
    ``g``'s rank ``r`` is bridge rank ``offset(g) + r``; its endpoint ``i`` (a unit: TP rank 0 of it,
    stride = tp; a consumer's unit is one data replica, or one (replica, CP rank) under context
    parallelism) is the one rank of those that talks to the bridge.
    """

    groups: tuple[tuple[str, int, int], ...]

    @property
    def world_size(self) -> int:
        return sum(w for _, w, _ in self.groups)

    def _offset(self, module: str) -> tuple[int, int]:
        offset = 0
        for name, world, stride in self.groups:
            if name == module:
                return offset, stride
            offset += world
        raise RuntimeFailure(
            f"the hand-off bridge has no group {module!r} (groups {[g[0] for g in self.groups]})"
        )

    def bridge_rank(self, module: str, rank: int) -> int:
        """The bridge rank of ``module``'s group rank ``rank``."""
        return self._offset(module)[0] + rank

    def endpoint(self, module: str, index: int) -> int:
        """Bridge rank of ``module``'s endpoint ``index`` (its unit's leader)."""
        offset, stride = self._offset(module)
        return offset + index * stride


class Bridge:
    """This rank's end of the two bridge communicators, with its in-flight sends.

    ``send`` returns at once (the transfer runs in the background; the tensor is kept until
    :meth:`drain`); ``recv`` returns when the rows arrived (on cuda: ordered before later work on
    the current stream).
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
    ) -> None:
        """Join the bridge. Blocks until all ``world_size`` ranks (both groups) joined."""
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self._store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self._pgs = {
            d: _make_backend(
                backend, dist.PrefixStore(f"dhp_bridge/{d}", self._store), rank, world_size, timeout, name=d
            )
            for d in DIRECTIONS
        }
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self._stale = False

    def send(self, t: torch.Tensor, *, dst: int, direction: str, tag: int) -> None:
        """Start sending ``t`` (contiguous) to bridge rank ``dst``; keep it alive until ``drain``."""
        self._check()
        t = t.contiguous()
        self._sends.append((self._pgs[direction].send([t], dst, tag), t))

    def recv(
        self,
        shape: tuple[int, ...],
        *,
        dtype: torch.dtype,
        device: torch.device,
        src: int,
        direction: str,
        tag: int,
    ) -> torch.Tensor:
        """Receive a ``shape`` tensor from bridge rank ``src`` into a new buffer (waits for it)."""
        self._check()
        buf = torch.empty(shape, dtype=dtype, device=device)
        self._pgs[direction].recv([buf], src, tag).wait()
        return buf

    def drain(self) -> None:
        """Wait for every send started so far (their receivers have posted: the step is over)."""
        sends, self._sends = self._sends, []
        for work, _ in sends:
            work.wait()

    def abandon(self) -> None:
        """A step was dropped half-way: sends may have no receiver, so the bridge cannot be reused."""
        if self._sends:
            self._stale = True
            self._sends = []

    def _check(self) -> None:
        if self._stale:
            raise RuntimeFailure(
                "the p2p hand-off bridge has transfers from an aborted step that were never received; "
                "it cannot be reused. Fix: restart the run (resume=auto continues from the last checkpoint)."
            )


def _make_backend(
    backend: str, store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta, *, name: str
) -> dist.ProcessGroup:
    """A standalone backend over ``store`` (not registered as, nor needing, a default world)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = False
        opts.group_name = f"dhp_bridge_{name}"
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"bridge backend must be gloo or nccl, got {backend!r}")
