"""Per-rank tensor memory by torch's own accounting: model states plus saved-for-backward bytes.

What one rank holds, counted from the tensors themselves (exact on any device, no allocator
needed; on CPU the process resident set is dominated by Python, torch and Ray, so it says little
about the model):

- ``params``, ``grads``, ``optimizer``: the unique storages of the module's parameters (a
  DTensor's local shard), their ``.grad`` and the optimizer's state tensors;
- ``saved``: the unique storages autograd holds for backward, caught by
  ``torch.autograd.graph.saved_tensors_hooks`` while a forward runs (including non-reentrant
  activation checkpointing's saved block inputs, which it saves through autograd), each counted at
  its size when sampled (a storage FSDP has resized to 0 after forward counts 0) and only while
  autograd holds it (a weakly referenced handle, freed with the graph). Storages of parameters are never
  counted twice. Not seen: the outputs selective checkpointing keeps in its own cache, and
  transient buffers freed inside a phase (the planner lists those separately).

The caller samples at the moments the planner's phases peak (the end of a forward, the end of a
backward, after the optimizer step); :meth:`MemoryAccountant.take` returns the largest sample and
its terms since the previous call. Opt-in: the worker builds one only when the environment variable
``DHP_MEMORY_ACCOUNTING`` names a directory, and appends each window's result there as JSON lines,
``<module>_<rank>.jsonl`` (``scripts/bench_planner.py`` reads them).
"""

from __future__ import annotations

import contextlib
import json
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

ENV_VAR = "DHP_MEMORY_ACCOUNTING"


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns storage: a DTensor's local shard, else the tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, nbytes) of ``t``'s storage; None for tensors without one (meta, wrappers)."""
    try:
        s = _local(t).untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return s.data_ptr(), s.nbytes()


def unique_storage_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views share one), minus those in ``exclude``
    (data pointers). Empty storages (size 0, e.g. resharded by FSDP) count 0."""
    seen: dict[int, int] = {}
    for t in tensors:
        key = _storage_key(t)
        if key is None or key[1] == 0 or (exclude and key[0] in exclude):
            continue
        seen[key[0]] = key[1]
    return sum(seen.values())


def state_tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, list]:
    """The parameter, gradient and optimizer-state tensors of one rank, by term."""
    params = list(module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = (
        [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        if optimizer is not None
        else []
    )
    return {"params": params, "grads": grads, "optimizer": states}


class _Saved:
    """What autograd holds instead of a saved tensor: the tensor, and a weak-referenceable handle
    that dies when autograd frees the graph (the tensor itself may outlive it elsewhere)."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def unpack(self) -> torch.Tensor:
        return self.tensor


class MemoryAccountant:
    """Counts one rank's model-state and saved-for-backward bytes (see the module docstring)."""

    def __init__(
        self,
        module: Callable[[], torch.nn.Module],
        optimizer: Callable[[], torch.optim.Optimizer | None],
    ) -> None:
        self._module, self._optimizer = module, optimizer
        self._saved: list[weakref.ref] = []
        self._peak: dict[str, int] = {}

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Record every tensor autograd saves inside the block (weakly), then sample."""

        def pack(t: torch.Tensor) -> _Saved:
            held = _Saved(t)
            self._saved.append(weakref.ref(held))
            return held

        with torch.autograd.graph.saved_tensors_hooks(pack, _Saved.unpack):
            yield
        self.sample()

    def terms(self) -> dict[str, int]:
        """Bytes live now: params, grads, optimizer states, saved tensors (unique storages each)."""
        st = state_tensors(self._module(), self._optimizer())
        out: dict[str, int] = {}
        taken: set[int] = set()
        for name in ("params", "grads", "optimizer"):
            out[name] = unique_storage_bytes(st[name], exclude=taken)
            taken |= {k[0] for k in map(_storage_key, st[name]) if k is not None}
        live = [h for h in (r() for r in self._saved) if h is not None]
        self._saved = [weakref.ref(h) for h in live]
        out["saved"] = unique_storage_bytes((h.tensor for h in live), exclude=taken)
        return out

    def sample(self) -> dict[str, int]:
        """Take the current terms; keep them when their total is the largest of this window."""
        now = self.terms()
        if sum(now.values()) > sum(self._peak.values()):
            self._peak = now
        return now

    def take(self) -> dict[str, int]:
        """The largest sample since the last call, ``{"total", <terms>}``; starts a new window."""
        peak, self._peak = self._peak, {}
        return {"total": sum(peak.values()), **peak}


def from_env(
    module: Callable[[], torch.nn.Module], optimizer: Callable[[], torch.optim.Optimizer | None]
) -> MemoryAccountant | None:
    """An accountant when ``DHP_MEMORY_ACCOUNTING`` is set (the opt-in), else None."""
    return MemoryAccountant(module, optimizer) if os.environ.get(ENV_VAR) else None


def saving(acct: MemoryAccountant | None) -> contextlib.AbstractContextManager:
    """``acct.saving()``, or a no-op without an accountant."""
    return acct.saving() if acct is not None else contextlib.nullcontext()


def sample(acct: MemoryAccountant | None) -> None:
    """``acct.sample()``, or nothing without an accountant."""
    if acct is not None:
        acct.sample()


def flush(acct: MemoryAccountant | None, *, module_name: str, rank: int) -> dict[str, Any] | None:
    """Append this window's peak to ``$DHP_MEMORY_ACCOUNTING/<module>_<rank>.jsonl``; returns it."""
    if acct is None:
        return None
    peak = acct.take()
    out = Path(os.environ[ENV_VAR])
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{module_name}_{rank}.jsonl").open("a") as f:
        f.write(json.dumps(peak) + "\n")
    return peak
