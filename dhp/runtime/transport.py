"""How hand-off tensors travel between actors, behind one interface.

- ``cpu``: Ray object store. ``pack`` gives a numpy *view* of the tensor (no copy); Ray writes it
  once into shared memory, and every reader on the node maps the same bytes (``unpack`` is a
  zero-copy ``torch.from_numpy`` of the read-only buffer). Memory: one copy in the object store.
- ``cuda_ipc`` (collocated groups on the same GPUs): ``pack`` gives a CUDA IPC handle
  (``torch.multiprocessing.reductions.reduce_tensor``) after synchronising the producer's stream;
  the producer keeps the tensor alive until ``release()``; ``unpack`` maps the same device memory.
  No bytes move at all.
- disaggregated GPU groups need Ray's GPU-object (NCCL) transport; it is not implemented yet and
  asking for it raises (never a silent detour through host memory).
"""

from __future__ import annotations

import warnings
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


class CudaIpcTransport:
    """CUDA IPC handles for groups that share GPUs (collocated)."""

    name = "cuda_ipc"

    def __init__(self) -> None:
        self._alive: list[torch.Tensor] = []

    def pack(self, t: torch.Tensor) -> Any:
        from torch.multiprocessing.reductions import reduce_tensor

        t = t.detach().contiguous()
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()  # consumer may read right away
        self._alive.append(t)
        return reduce_tensor(t)

    def unpack(self, payload: Any, *, device: torch.device) -> torch.Tensor:
        rebuild, args = payload
        return rebuild(*args).to(device)

    def release(self) -> None:
        """Drop the producer's references once every consumer finished the step."""
        self._alive.clear()


def make_transport(*, device: str, placement: str) -> Transport:
    """The transport for a cluster device and placement (cpu -> object store, cuda -> IPC or NCCL)."""
    if device == "cpu":
        return CpuTransport()
    if placement == "collocated":
        return CudaIpcTransport()
    raise PlanError(
        "placement=disaggregated on cuda needs Ray's GPU-object (NCCL) hand-off, which dhp does not "
        "implement yet. Fix: use placement=collocated on GPUs, or cluster.device=cpu."
    )
