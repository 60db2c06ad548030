"""How hand-off tensors travel between actors: one channel interface, three implementations.

Every channel: ``pack(t, *, to, tag, direction)`` on the sending rank returns a small picklable
payload that travels as the worker method's result (a Ray object ref the driver routes without
looking inside); ``unpack(payload, *, device, tag, direction)`` on a receiving rank gives the tensor.
``to = (module, endpoint index)`` names the receiver (a consumer's data replica, or a producer's unit),
``tag`` the micro-batch, ``direction`` ``fwd`` (rows) or ``bwd`` (their gradients). ``leader_only``:
only an endpoint's leader may unpack (it broadcasts to its peers); ``release()`` after the step's
update, ``drain()`` at the end of the backward, ``abandon()`` when a step is dropped; ``connect(...)``
joins what the channel needs (the bridge's communicators; nothing for the others).

- ``cpu``: Ray object store. ``pack`` gives a numpy *view* of the tensor (no copy; bf16 rows as an
  int16 view of their bits, :class:`Bf16Bits`, since numpy has no bfloat16); Ray writes it
  once into shared memory, and every reader on the node maps the same bytes (``unpack`` is a
  zero-copy ``torch.from_numpy`` of the read-only buffer). Memory: one copy in the object store.
- ``cuda_ipc`` (collocated groups on the same GPUs): ``pack`` gives a CUDA IPC memory handle
  (``torch.multiprocessing.reductions.reduce_tensor``) plus the IPC handle of an interprocess CUDA
  event recorded on the producer's current stream after the tensor was written; the producer's CPU
  never blocks. ``unpack`` maps the same device memory and makes the consumer's stream wait on that
  event. The producer keeps tensor and event alive until ``release()``. No bytes move at all.
- ``p2p`` (disaggregated GPU groups, or on request on cpu): :class:`BridgeTransport`. ``pack`` starts a
  send over point-to-point process groups between the groups (``dhp.runtime.handoff.bridge``) and returns a
  ticket (shape, dtype, sender); ``unpack`` receives from that sender. Only endpoint leaders talk to
  the bridge (``leader_only``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch.multiprocessing.reductions import reduce_tensor

from dhp.errors import PlanError
from dhp.runtime.handoff.bridge import Bridge


class Transport(Protocol):
    """Pack a tensor on the sending rank, unpack it on a receiving rank (see the module docstring)."""

    name: str
    leader_only: bool

    def connect(self, **kwargs: Any) -> None: ...

    def pack(self, t: torch.Tensor, **where: Any) -> Any: ...

    def unpack(self, payload: Any, *, device: torch.device, **where: Any) -> torch.Tensor: ...

    def release(self) -> None: ...

    def drain(self) -> None: ...

    def abandon(self) -> None: ...


class _RayTransport:
    """What the object-passing channels share: nothing to join, nothing in flight outside Ray."""

    leader_only = False

    def connect(self, **kwargs: Any) -> None:
        return None

    def drain(self) -> None:
        return None

    def abandon(self) -> None:
        self.release()

    def release(self) -> None:
        return None


@dataclass(frozen=True)
class Bf16Bits:
    """bf16 rows in the object store: numpy has no bfloat16, so their bits travel as an int16 view
    (still zero-copy, 2 bytes per element) and are viewed back as bfloat16 on unpack."""

    bits: np.ndarray


class CpuTransport(_RayTransport):
    """Object-store transport with zero-copy numpy views (see module docstring)."""

    name = "cpu"

    def pack(self, t: torch.Tensor, **where: Any) -> np.ndarray | Bf16Bits:
        t = t.detach().contiguous()
        return Bf16Bits(t.view(torch.int16).numpy()) if t.dtype == torch.bfloat16 else t.numpy()

    def unpack(self, payload: np.ndarray | Bf16Bits, *, device: torch.device, **where: Any) -> torch.Tensor:
        with warnings.catch_warnings():  # the object store buffer is read-only; we never write to it
            warnings.simplefilter("ignore", UserWarning)
            if isinstance(payload, Bf16Bits):
                return torch.from_numpy(payload.bits).view(torch.bfloat16).to(device)
            return torch.from_numpy(payload).to(device)

    def release(self) -> None:
        return None


IpcPayload = tuple[tuple[Callable[..., torch.Tensor], tuple[Any, ...]], bytes | None, int | None]
"""What ``CudaIpcTransport.pack`` ships: ``(reduce_tensor(t), event IPC handle, CUDA device index)``.

A plain tuple on purpose: it pickles through Ray, ``torch.multiprocessing`` queues and a transport
module loaded by path (``scripts/gpu``) alike. For a CPU tensor the event and device are ``None``.
"""


class CudaIpcTransport(_RayTransport):
    """CUDA IPC handles plus an interprocess event, for groups that share GPUs (collocated).

    ``pack`` records a ``torch.cuda.Event(interprocess=True)`` on the producer's current stream of the
    tensor's device, instead of synchronising that stream: the CPU goes on while the kernels that
    write the tensor may still be running. The consumer's ``unpack`` opens the event and makes its
    current stream on that device wait for it, so every kernel it enqueues there afterwards (the
    copy into its own buffer included) reads the finished bytes. Work on *another* consumer stream
    needs its own ``wait_stream``.

    Memory: nothing is copied. The producer holds a reference to each packed tensor (and its event)
    until ``release()``, so the caching allocator cannot hand those blocks out again while a consumer
    may read them; call ``release()`` only after every consumer finished with the step's payloads.
    The device index in the payload is the producer's; like ``torch.multiprocessing`` itself, this
    assumes both processes number the GPUs the same way. dhp's actors do: each sees every GPU of
    its node (``dhp.runtime.launch.devices``), which also lets an LLM rank read rows from a vision rank on
    another GPU of the node (collocated SP/TP groups exchange rows across GPUs, copied over NVLink).

    torch's own sharing (``_share_cuda_``) also records an event, but a consumer that still maps
    the same storage skips it (``rebuild_cuda_tensor``'s cache hit), and past 1000 live events it
    synchronises the producer's stream instead: the per-``pack`` event here orders every hand-off
    either way. CPU tensors (the ``--cpu`` dry runs) travel as a plain ``reduce_tensor``, no event.
    """

    name = "cuda_ipc"

    def __init__(self) -> None:
        self._alive: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []

    def pack(self, t: torch.Tensor, **where: Any) -> IpcPayload:
        """IPC handles for ``t`` (contiguous; a copy only if it was not) and an event after its writes.

        Does not block the CPU. Keeps ``t`` and the event alive until ``release()``.
        """

        t = t.detach().contiguous()
        if not t.is_cuda:
            self._alive.append((t, None))
            return reduce_tensor(t), None, None
        event = torch.cuda.Event(interprocess=True)  # interprocess implies no timing
        event.record(torch.cuda.current_stream(t.device))  # after every kernel enqueued so far
        self._alive.append((t, event))
        return reduce_tensor(t), event.ipc_handle(), t.device.index

    def unpack(self, payload: IpcPayload, *, device: torch.device, **where: Any) -> torch.Tensor:
        """Map the producer's memory (no copy) after ordering this process's stream behind its event.

        The wait goes on the current stream of the producer's device index: the stream a same-device
        consumer computes on, and the one a cross-device or device-to-host ``.to(device)`` copies on.
        Returns the mapped tensor itself when it already lives on ``device``, else a copy there.
        """
        (rebuild, args), event_handle, index = payload
        if event_handle is not None:
            src = torch.device("cuda", index)
            event = torch.cuda.Event.from_ipc_handle(src, event_handle)
            torch.cuda.current_stream(src).wait_event(event)  # enqueued; the CPU does not block
        return rebuild(*args).to(device)

    def release(self) -> None:
        """Drop the producer's references (tensors and events) once every consumer finished the step."""
        self._alive.clear()


@dataclass(frozen=True)
class BridgeTicket:
    """What a bridge send leaves for the receiver: the rows' shape and dtype, and who sent them."""

    src: int
    shape: tuple[int, ...]
    dtype: str


class BridgeTransport:
    """The ``p2p`` channel: rows over the bridge's point-to-point communicators (``dhp.runtime.handoff.bridge``).

    ``pack`` starts the send to ``to``'s endpoint and returns a :class:`BridgeTicket`; ``unpack``
    receives it (each side issues its operations in the driver's order: micro-batch, then source,
    then destination, so neither communicator can deadlock). Sent tensors stay referenced until
    ``drain`` (end of the step's backward).
    """

    name = "p2p"
    leader_only = True

    def __init__(self, layout: Any, module: str, rank: int) -> None:
        self.layout, self.module, self.rank = layout, module, rank
        self.bridge: Any = None

    def connect(self, *, host: str, port: int, backend: str, timeout_s: float) -> None:
        """Join the bridge (every rank of every group; blocks until all joined)."""

        self.bridge = Bridge(
            host=host,
            port=port,
            rank=self.layout.bridge_rank(self.module, self.rank),
            world_size=self.layout.world_size,
            backend=backend,
            timeout_s=timeout_s,
        )

    def pack(self, t: torch.Tensor, *, to: tuple[str, int], tag: int, direction: str) -> BridgeTicket:
        self.bridge.send(t, dst=self.layout.endpoint(*to), direction=direction, tag=tag)
        me = self.layout.bridge_rank(self.module, self.rank)
        return BridgeTicket(src=me, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))

    def unpack(
        self, payload: BridgeTicket, *, device: torch.device, tag: int, direction: str
    ) -> torch.Tensor:
        dtype = getattr(torch, payload.dtype)
        return self.bridge.recv(
            payload.shape, dtype=dtype, device=device, src=payload.src, direction=direction, tag=tag
        )

    def release(self) -> None:
        return None

    def drain(self) -> None:
        if self.bridge is not None:
            self.bridge.drain()

    def abandon(self) -> None:
        if self.bridge is not None:
            self.bridge.abandon()


def make_transport(handoff: str, *, bridge_layout: Any = None, module: str = "", rank: int = 0) -> Transport:
    """The channel of a resolved hand-off (``dhp.config.handoff``): ``object_store`` -> :class:`CpuTransport`,
    ``cuda_ipc`` -> :class:`CudaIpcTransport`, ``p2p`` -> :class:`BridgeTransport` over ``bridge_layout``."""
    if handoff == "object_store":
        return CpuTransport()
    if handoff == "cuda_ipc":
        return CudaIpcTransport()
    if handoff == "p2p":
        return BridgeTransport(bridge_layout, module, rank)
    raise PlanError(f"unknown hand-off {handoff!r}: expected object_store, cuda_ipc or p2p")
