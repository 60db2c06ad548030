"""Which run directory a resumed run writes into.

A run resumed from one of its own checkpoints continues that run directory: one
``metrics.jsonl`` (a ``{"event": "resume"}`` line, then the steps after the checkpoint), the same
TensorBoard log dir, the same W&B and MLflow runs (``trackers.json``), the same ``checkpoints/``.
``train.resume=auto`` picks the newest verified checkpoint of the run name, so it always continues;
an explicit checkpoint PATH continues when it lies in this run name's own directory
(``<output_dir>/<name>/<started>/checkpoints/step_N``). ``train.resume=fork`` resumes the same
checkpoint as ``auto`` into a new run directory (new tracker runs), as does a PATH of another run.
"""

from __future__ import annotations

import time
from pathlib import Path

FORK = "fork"


def continued_run_dir(resume: Path | None, *, output_dir: str, name: str) -> Path | None:
    """The run directory ``resume`` (a ``step_N`` checkpoint) belongs to when it is one of run
    ``name``'s own under ``output_dir``; None when there is nothing to continue."""
    if resume is None:
        return None
    ckpts = Path(resume).resolve().parent
    if ckpts.name != "checkpoints" or ckpts.parent.parent != (Path(output_dir) / name).resolve():
        return None
    return Path(resume).parent.parent


def resume_event(resume: Path, *, step: int) -> dict:
    """The ``{"event": "resume", ...}`` line a continued run appends before its first step."""
    return {"event": "resume", "step": step, "time": time.time(), "resume_from": str(resume)}
