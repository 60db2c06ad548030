"""Asynchronous checkpoints on the driver (``checkpoint.async_save: true``): at most one in flight.

``start`` (at a checkpoint step): wait for and commit the previous save if one is still in flight,
open ``step_XXXXXX.tmp-<pid>/``, capture the driver side (loader position, LR schedule, driver RNG)
into the meta now, and have every rank of every group stage its shards to host memory and start
writing them in the background (``ModuleWorker.save_checkpoint_async``); the step loop then goes
on. ``poll`` (each step boundary) commits the checkpoint as soon as every rank's write is done:
manifest (checksums of the files as written), ``meta.json``, then one rename. Until then it is a
temp dir that no resume considers, so a crash mid-save leaves the previous checkpoint the newest
good one (and the next start removes the temp dir). ``abandon`` forgets an in-flight save after
its writers are gone and deletes its temp dir.

Each commit adds an ``{"event": "checkpoint", ...}`` line to metrics.jsonl with the seconds the
step loop was held (staging) and the seconds the background write took.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dhp.checkpoint import begin_checkpoint, commit_checkpoint, find_latest_checkpoint
from dhp.errors import RuntimeFailure
from dhp.runtime.loop.worker import ModuleWorker


def is_io_failure(text: str) -> bool:
    """A rank's save failed on the filesystem (DCP wraps the OSError in a CheckpointException)."""
    return "[Errno" in text or "CheckpointException" in text or "No space left" in text


class SaveFailed(RuntimeFailure):
    """Writing a checkpoint failed (disk full, not writable): restarting would not help."""


def save_failed(run_dir: Path, step: int, e: BaseException) -> SaveFailed:
    """The SaveFailed for ``step``: what failed, the checkpoint kept, and the fix."""
    prev = find_latest_checkpoint(output_dir=run_dir.parent.parent, name=run_dir.parent.name)
    why = getattr(e, "strerror", None) or str(e).splitlines()[0]
    return SaveFailed(
        f"saving the step {step} checkpoint under {run_dir / 'checkpoints'} failed: {why}; "
        f"the previous checkpoint is kept: {prev or 'none'}. Fix: free disk space or make the "
        "directory writable, then resume with train.resume=auto."
    )


@dataclass
class _InFlight:
    step: int
    tmp: Path
    meta: Any  # CheckpointMeta, captured at the step boundary the save belongs to
    staging_s: float


class AsyncCheckpoints:
    """The driver's side of asynchronous saves for one life of the actor groups."""

    def __init__(
        self, trainer: Any, *, config: Any, run_dir: Path, hold: Callable[[], Any] = contextlib.nullcontext
    ) -> None:
        """``hold``: a context no signal cuts, around each commit (``interrupts.Signals.held``)."""
        self.trainer, self.config, self.run_dir, self.hold = trainer, config, run_dir, hold
        self.inflight: _InFlight | None = None

    @property
    def step(self) -> int | None:
        """The step of the save in flight, if any."""
        return None if self.inflight is None else self.inflight.step

    def start(self, *, step: int, meta: Any) -> Path | None:
        """Begin saving ``step`` (meta already captured); returns the checkpoint committed on the way
        (the previous save, waited for), if any."""
        committed = self.finish()
        try:
            tmp = begin_checkpoint(self.run_dir / "checkpoints", step=step)
        except OSError as e:
            raise save_failed(self.run_dir, step, e) from e
        self.inflight = _InFlight(step=step, tmp=tmp, meta=meta, staging_s=0.0)
        t0 = time.perf_counter()
        groups = self.trainer.groups
        try:
            pend = {n: g.submit(ModuleWorker.save_checkpoint_async, f"{tmp}/{n}") for n, g in groups.items()}
            for n, g in groups.items():
                g.collect(pend[n])
        except RuntimeFailure as e:
            raise self._failed(e) from e
        self.inflight.staging_s = time.perf_counter() - t0
        return committed

    def poll(self) -> Path | None:
        """Commit the in-flight save if every rank's write is done; the committed path, else None."""
        return self._settle(wait=False)

    def finish(self) -> Path | None:
        """Wait for the in-flight save (if any) and commit it; the committed path, else None."""
        return self._settle(wait=True)

    def abandon(self) -> None:
        """Forget the in-flight save and delete its temp dir (call after its writers are gone)."""
        if self.inflight is not None:
            shutil.rmtree(self.inflight.tmp, ignore_errors=True)
        self.inflight = None

    def _settle(self, *, wait: bool) -> Path | None:
        if self.inflight is None:
            return None
        try:
            status = {
                n: g.call(ModuleWorker.checkpoint_write_status, wait=wait)
                for n, g in self.trainer.groups.items()
            }
        except RuntimeFailure as e:
            raise self._failed(e) from e
        ranks = [s for per_rank in status.values() for s in per_rank]
        tmp = str(self.inflight.tmp)
        if any(s is None or not s["path"].startswith(tmp) for s in ranks):  # a replaced actor
            raise self._failed(RuntimeFailure(f"a rank lost the checkpoint write into {tmp} (restarted?)"))
        if not all(s["done"] for s in ranks):
            return None
        return self._commit(write_s=max(s["write_s"] for s in ranks))

    def _commit(self, *, write_s: float) -> Path:
        """Manifest, meta and rename, then the metrics event; a second signal waits for all of it."""
        f = self.inflight
        with self.hold():
            try:
                final = commit_checkpoint(f.tmp, meta=f.meta, keep_last=self.config.train.keep_last)
            except OSError as e:
                raise save_failed(self.run_dir, f.step, e) from e
            self.inflight = None
            rec = {
                "event": "checkpoint",
                "step": f.step,
                "path": str(final),
                "async": True,
                "staging_s": round(f.staging_s, 4),
                "write_s": round(write_s, 4),
                "time": time.time(),
            }
            with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as fh:
                fh.write(json.dumps(rec) + "\n")
        return final

    def _failed(self, e: RuntimeFailure) -> RuntimeFailure:
        """A failed write (disk full, not writable) is a SaveFailed (not restarted); a dead actor or
        collective stays what it is (the run may restart). The temp dir stays in flight until
        ``abandon`` (after the actors are gone, so no writer recreates files in it)."""
        step = self.inflight.step if self.inflight else 0
        text = str(e)
        if "asynchronous save to" in text or is_io_failure(text):
            return save_failed(self.run_dir, step, e)
        return e
