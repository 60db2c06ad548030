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
  autograd holds it (a weakly referenced handle, freed with the graph), and the outputs selective
  checkpointing keeps in its own cache (``dhp.parallel.ac.CACHE_OBSERVERS``: each region's cache,
  weakly, until backward consumes its entries). Storages of parameters are never counted twice. Not
  seen: transient buffers freed inside a phase (the planner lists those separately).

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

from dhp.parallel.ac import CACHE_OBSERVERS

ENV_VAR = "DHP_MEMORY_ACCOUNTING"


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns storage: a DTensor's local shard, else the tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, nbytes) of ``t``'s storage; None for tensors without one (meta, wrappers) and
    for one whose storage is no longer valid (freed: it holds no memory)."""
    try:
        s = _local(t).untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


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


def cached_tensors(region: Any) -> list[torch.Tensor]:
    """The tensors a selective-checkpoint region's recompute context still holds for backward (its
    ``storage``: op key -> call index -> the kept outputs, wrapped; consumed entries are markers)."""
    out: list[torch.Tensor] = []
    for calls in getattr(region, "storage", {}).values():
        for entry in calls.values():
            stack = [entry]
            while stack:
                item = stack.pop()
                if isinstance(item, list | tuple):
                    stack.extend(item)
                    continue
                value = getattr(item, "val", None)
                if isinstance(value, torch.Tensor):
                    out.append(value)
    return out


class MemoryAccountant:
    """Counts one rank's model-state and saved-for-backward bytes (see the module docstring)."""

    def __init__(
        self,
        module: Callable[[], torch.nn.Module],
        optimizer: Callable[[], torch.optim.Optimizer | None],
    ) -> None:
        self._module, self._optimizer = module, optimizer
        self._saved: list[weakref.ref] = []
        self._regions: list[weakref.ref] = []  # selective checkpointing's caches
        self._peak: dict[str, int] = {}

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Record every tensor autograd saves inside the block (weakly), then sample."""

        def pack(t: torch.Tensor) -> _Saved:
            held = _Saved(t)
            self._saved.append(weakref.ref(held))
            return held

        def observe(region: Any) -> None:
            self._regions.append(weakref.ref(region))

        CACHE_OBSERVERS.append(observe)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, _Saved.unpack):
                yield
        finally:
            CACHE_OBSERVERS.remove(observe)
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
        regions = [g for g in (r() for r in self._regions) if g is not None]
        self._regions = [weakref.ref(g) for g in regions]
        cached = [t for g in regions for t in cached_tensors(g)]
        out["saved"] = unique_storage_bytes([*(h.tensor for h in live), *cached], exclude=taken)
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


def saved_by_part(
    run: Callable[[], Any], parts: dict[str, torch.nn.Module], exclude: Iterable[torch.Tensor]
) -> tuple[dict[str, int], Any]:
    """(bytes saved for backward while each of ``parts`` runs, by name, ``""`` for the rest; the
    result of ``run()``): one forward under autograd's saved-tensor hooks and selective
    checkpointing's caches (as :class:`MemoryAccountant` counts them), each storage once, in the part
    that saved it first; ``exclude``'s storages (parameters) never. A measuring tool for one forward
    (the planner's per-block terms), not for a running rank."""
    where = [""]
    regions: list[Any] = []
    marks: dict[int, set] = {}
    cached: dict[int, tuple[str, torch.Tensor]] = {}

    def entries() -> set:
        return {(n, k, i) for n, r in enumerate(regions) for k, calls in r.storage.items() for i in calls}

    def enter(name: str) -> Callable:
        def hook(*_: Any) -> None:
            where[0], marks[id(parts[name])] = name, entries()

        return hook

    def leave(name: str) -> Callable:
        def hook(*_: Any) -> None:
            for n, k, i in sorted(entries() - marks[id(parts[name])], key=str):
                for t in cached_tensors(_One(regions[n].storage[k][i])):
                    cached.setdefault(id(t), (name, t))
            where[0] = ""

        return hook

    skip = {k[0] for k in map(_storage_key, exclude) if k is not None}
    seen: dict[int, tuple[str, int]] = {}

    def note(name: str, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key is not None and key[1] and key[0] not in skip and key[0] not in seen:
            seen[key[0]] = (name, key[1])

    def pack(t: torch.Tensor) -> torch.Tensor:
        note(where[0], t)
        return t

    handles = []
    for name, mod in parts.items():
        handles += [mod.register_forward_pre_hook(enter(name)), mod.register_forward_hook(leave(name))]
    CACHE_OBSERVERS.append(regions.append)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = run()
    finally:
        CACHE_OBSERVERS.remove(regions.append)
        for h in handles:
            h.remove()
    for name, t in cached.values():
        note(name, t)
    for t in (t for r in regions for t in cached_tensors(r)):
        note("", t)
    out: dict[str, int] = {}
    for name, nbytes in seen.values():
        out[name] = out.get(name, 0) + nbytes
    return out, result


class _One:
    """One cache entry presented as a region with one op (for :func:`cached_tensors`)."""

    def __init__(self, entry: Any) -> None:
        self.storage = {None: {0: entry}}
