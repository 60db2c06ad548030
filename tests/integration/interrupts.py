"""Runs interrupted at a chosen point (the ``DHP_INJECT_FAULT`` hook), and what they must leave behind
(imported as a sibling module, like ``procs``): shared by the interrupt tests.

A rank's fault sends the signal to the driver from inside the named part of the step (then sleeps
0.5 s, so the driver takes it while that part still runs); a ``driver`` fault sends it between rank
0's and rank 1's submission of a call, the window a signal that raised at once used to cut.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from procs import alive, descendants

#: an interrupted run ends within this many seconds of its signal: the step running (tiny model:
#: under 1 s), one checkpoint, the teardown (a busy 2-core box: each can take several seconds)
STOP_BOUND_S = 45.0

#: the placements of the tiny recipe the interrupt tests run (overrides); disaggregated: the vision
#: encoder on a GPU of its own, the LLM (TP=2) on two others
PLACEMENTS = {
    "collocated": (),
    "disaggregated": ("placement=disaggregated", "modules.vision.gpus=1", "modules.vision.parallel.sp=1"),
}


@dataclass
class Interrupted:
    """One run through ``dhp.runtime.loop.train.train`` with a fault set."""

    result: object  # RunResult
    console: str
    stop_s: float | None  # seconds from the first signal to train() returning
    orphans: list[int]  # rank processes of this run still alive after it


def train_with_fault(cfg, fault: str | None) -> Interrupted:
    """``train(cfg)`` in this process with ``$DHP_INJECT_FAULT=fault``; Ctrl-C is given its default
    handling for the run (a suite started in the background inherits it ignored), so a SIGINT ends
    in RunInterrupted after the graceful stop: its result is returned."""
    from rich.console import Console

    from dhp.runtime.actors.failures import FAULT_ENV
    from dhp.runtime.loop.interrupts import RunInterrupted
    from dhp.runtime.loop.train import train

    before = set(rank_processes())
    out = io.StringIO()
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.MonkeyPatch.context() as mp:
            if fault:
                mp.setenv(FAULT_ENV, fault)
            else:
                mp.delenv(FAULT_ENV, raising=False)
            try:
                result = train(cfg, console=Console(file=out, width=250))
            except RunInterrupted as stop:  # Python's own Ctrl-C handling: raised after the stop
                result = stop.result
    finally:
        signal.signal(signal.SIGINT, old)
    stop_s = None if result.signal_time is None else time.monotonic() - result.signal_time
    return Interrupted(result, out.getvalue(), stop_s, orphans_since(before))


def checkpoints(run_dir: Path) -> tuple[list[int], list[str]]:
    """(steps of the complete checkpoints, names of anything else: temp dirs of a save)."""
    root = run_dir / "checkpoints"
    names = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    done = [
        int(n.split("_")[1]) for n in names if n.startswith("step_") and (root / n / "meta.json").is_file()
    ]
    return done, [n for n in names if n not in {f"step_{s:06d}" for s in done}]


def logged(run_dir: Path) -> dict[int, list[float]]:
    """``{step: [loss of each record of that step]}`` in metrics.jsonl (a step a hard stop lost is
    run again by the resume: two records)."""
    out: dict[int, list[float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            out.setdefault(row["step"], []).append(row["loss"])
    return out


def rank_processes() -> list[int]:
    """This process's rank actors (the shared test Ray forks them below this process)."""
    out = []
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError):
            if b"ModuleWorker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
    return out


def orphans_since(before: set[int], wait_s: float = 15.0) -> list[int]:
    """Rank processes started since ``before`` still alive after ``wait_s`` (Ray kills an actor's
    process asynchronously)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = [p for p in rank_processes() if p not in before and alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)
