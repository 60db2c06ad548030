"""How hand-off tensors travel between actors, behind one interface.

- ``cpu``: Ray object store. ``pack`` gives a numpy *view* of the tensor (no copy); Ray writes it
  once into shared memory, and every reader on the node maps the same bytes (``unpack`` is a
  zero-copy ``torch.from_numpy`` of the read-only buffer). Memory: one copy in the object store.
- ``cuda_ipc`` (collocated groups on the same GPUs): ``pack`` gives a CUDA IPC memory handle
  (``torch.multiprocessing.reductions.reduce_tensor``) plus the IPC handle of an interprocess CUDA
  event recorded on the producer's current stream after the tensor was written; the producer's CPU
  never blocks. ``unpack`` maps the same device memory and makes the consumer's stream wait on that
  event. The producer keeps tensor and event alive until ``release()``. No bytes move at all.
- ``p2p`` (disaggregated GPU groups, or on request on cpu) is not an object transport: rows go
  over point-to-point process groups between the two groups, see ``dhp.runtime.bridge``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from dhp.errors import PlanError


class Transport(Protocol):
    """Pack a tensor on the producer, unpack it on a consumer."""

    name: str

    def pack(self, t: torch.Tensor) -> Any: ...

    def unpack(self, payload: Any, *, device: torch.device) -> torch.Tensor: ...

    def release(self) -> None: ...


class CpuTransport:
    """Object-store transport with zero-copy numpy views (see module docstring)."""

    name = "cpu"

    def pack(self, t: torch.Tensor) -> np.ndarray:
        return t.detach().contiguous().numpy()

    def unpack(self, payload: np.ndarray, *, device: torch.device) -> torch.Tensor:
        with warnings.catch_warnings():  # the object store buffer is read-only; we never write to it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(payload).to(device)

    def release(self) -> None:
        return None


IpcPayload = tuple[tuple[Callable[..., torch.Tensor], tuple[Any, ...]], bytes | None, int | None]
"""What ``CudaIpcTransport.pack`` ships: ``(reduce_tensor(t), event IPC handle, CUDA device index)``.

A plain tuple on purpose: it pickles through Ray, ``torch.multiprocessing`` queues and a transport
module loaded by path (``scripts/gpu``) alike. For a CPU tensor the event and device are ``None``.
"""


class CudaIpcTransport:
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
    its node (``dhp.runtime.devices``), which also lets an LLM rank read rows from a vision rank on
    another GPU of the node (collocated SP/TP groups exchange rows across GPUs, copied over NVLink).

    torch's own sharing (``_share_cuda_``) also records an event, but a consumer that still maps
    the same storage skips it (``rebuild_cuda_tensor``'s cache hit), and past 1000 live events it
    synchronises the producer's stream instead: the per-``pack`` event here orders every hand-off
    either way. CPU tensors (the ``--cpu`` dry runs) travel as a plain ``reduce_tensor``, no event.
    """

    name = "cuda_ipc"

    def __init__(self) -> None:
        self._alive: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []

    def pack(self, t: torch.Tensor) -> IpcPayload:
        """IPC handles for ``t`` (contiguous; a copy only if it was not) and an event after its writes.

        Does not block the CPU. Keeps ``t`` and the event alive until ``release()``.
        """
        from torch.multiprocessing.reductions import reduce_tensor

        t = t.detach().contiguous()
        if not t.is_cuda:
            self._alive.append((t, None))
            return reduce_tensor(t), None, None
        event = torch.cuda.Event(interprocess=True)  # interprocess implies no timing
        event.record(torch.cuda.current_stream(t.device))  # after every kernel enqueued so far
        self._alive.append((t, event))
        return reduce_tensor(t), event.ipc_handle(), t.device.index

    def unpack(self, payload: IpcPayload, *, device: torch.device) -> torch.Tensor:
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


def make_transport(handoff: str) -> Transport | None:
    """The object-passing transport for a resolved hand-off (``dhp.config.handoff``); None for
    ``p2p``, whose rows go over the bridge process groups (``dhp.runtime.bridge``), not Ray."""
    if handoff == "object_store":
        return CpuTransport()
    if handoff == "cuda_ipc":
        return CudaIpcTransport()
    if handoff == "p2p":
        return None
    raise PlanError(f"unknown hand-off {handoff!r}: expected object_store, cuda_ipc or p2p")
