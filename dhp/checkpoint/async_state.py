"""Asynchronous save of one module group's state (worker side), through torch DCP's ``async_save``.

``save_module_state_async`` runs inside every rank of ONE group, collectively, like
:func:`dhp.checkpoint.save_module_state`, and writes the same files. It returns once this rank's
shards are staged: copied into host memory (one extra copy of the rank's model + optimizer shard
in RAM until the write ends), so training may change the parameters at once. A background thread
then plans and writes the files, with its cross-rank steps on a dedicated gloo process group (the
training collectives keep the default group to themselves; async save needs a CPU backend).

At most one save is in flight per process; :func:`async_save_status` polls it or waits for it
(a finished save keeps being reported as done until the next one starts, so a poll never loses
it), and re-raises the write's error once. Nothing here commits a checkpoint: the driver does (manifest,
``meta.json``, rename) after every rank of every group reported its write done.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from dhp.checkpoint.module_state import MODULE_FILE, _distributed, _rank_world, _state, single_process_quiet
from dhp.errors import CheckpointError


@dataclass
class _InFlight:
    path: Path
    future: Future
    started: float  # perf_counter when the write began (after staging)
    staging_s: float
    ended: float | None = None  # perf_counter when the write finished (set by the future's callback)


_pending: _InFlight | None = None
_group: Any = None  # the gloo group the background writes synchronise on (one per process)


def _checkpoint_group() -> Any:
    """A gloo group over this group's whole world, made once (collective: every rank calls it at the
    first async save, at the same point)."""
    global _group
    if _group is None:
        _group = dist.new_group(backend="gloo")
    return _group


def save_module_state_async(
    path: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any] | None = None,
) -> float:
    """Stage ``model`` (+ ``optimizer``) to host memory and start writing them to ``path`` in the
    background; returns the staging time in seconds. CheckpointError if a save is still in flight
    here (the driver waits for the previous one first)."""
    global _pending
    if _pending is not None and not _pending.future.done():
        raise CheckpointError(
            f"an asynchronous checkpoint save to {_pending.path} is still in flight on this rank; "
            "the driver must wait for it before starting another."
        )
    path = Path(path)
    t0 = time.perf_counter()
    rank, world = _rank_world()
    (path / "extra").mkdir(parents=True, exist_ok=True)
    torch.save(extra or {}, path / "extra" / f"rank_{rank}.pt")
    if rank == 0:
        info = {"world_size": world, "has_optimizer": optimizer is not None}
        (path / MODULE_FILE).write_text(json.dumps(info))
    group = _checkpoint_group() if _distributed() else None
    with single_process_quiet():
        future = dcp.async_save(
            _state(model, optimizer), checkpoint_id=str(path), process_group=group, no_dist=group is None
        )
    staged = time.perf_counter()
    inflight = _InFlight(path=path, future=future, started=staged, staging_s=staged - t0)
    future.add_done_callback(lambda _: setattr(inflight, "ended", time.perf_counter()))
    _pending = inflight
    return staged - t0


def async_save_status(*, wait: bool) -> dict[str, Any] | None:
    """This rank's latest save: None when there is none; else ``{"path", "done", "staging_s",
    "write_s"}`` (``write_s`` once done). ``wait``: block until it is done. A failed write raises
    CheckpointError naming the path and the cause, and the save is forgotten."""
    global _pending
    p = _pending
    if p is None:
        return None
    if not (wait or p.future.done()):
        return {"path": str(p.path), "done": False, "staging_s": p.staging_s, "write_s": None}
    try:
        p.future.result()
    except BaseException as e:
        _pending = None
        lines = str(e).strip().splitlines()
        cause = getattr(e, "strerror", None) or (lines[-1] if lines else type(e).__name__)
        raise CheckpointError(f"the asynchronous save to {p.path} failed: {cause}") from e
    return {
        "path": str(p.path),
        "done": True,
        "staging_s": p.staging_s,
        "write_s": (p.ended or time.perf_counter()) - p.started,
    }
