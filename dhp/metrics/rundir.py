"""Reading a run directory's ``metrics.jsonl`` in whatever state a run left it.

A run directory may be empty, hold only ``config.yaml``, end with a line a kill cut short, hold only
events (a run that failed or restarted before its first logged step), be resumed in place (a
``resume`` event, then steps again), or come from an older dhp whose records lack some of today's
keys. ``dhp runs`` and ``dhp report`` read it through :func:`read_run_log`, which never raises on
any of these: lines that do not parse are counted, not fatal.

Lines are of two kinds: step records (``"step"`` and ``"loss"``, the fixed names of
``dhp.metrics.writer.METRIC_KEYS``) and events (``{"event": "start" | "restart" | "resume" |
"failed" | "eval", "step": N, ...}``, where ``step`` is the step training continues after (0 for
``start``), the step that failed, or the step an evaluation followed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Mark:
    """A discontinuity before step record ``index``: a restart or resume (``why`` says which)."""

    index: int
    step: int
    why: str


@dataclass
class RunLog:
    """The parsed lines of one ``metrics.jsonl``, in file order."""

    records: list[dict[str, Any]] = field(default_factory=list)  # step records
    events: list[dict[str, Any]] = field(default_factory=list)  # start / restart / resume / failed / eval
    marks: list[Mark] = field(default_factory=list)  # restarts and resumes, at record indices
    bad_lines: int = 0  # lines that are not a JSON object (a write cut short by a kill)
    last: dict[str, Any] | None = None  # the last line read (a record or an event)

    @property
    def evals(self) -> list[dict[str, Any]]:
        """The ``eval`` events (``step``, ``eval_loss``, ...), in file order."""
        return [
            e for e in self.events if e["event"] == "eval" and isinstance(e.get("eval_loss"), int | float)
        ]

    @property
    def total_steps(self) -> int | None:
        """The run's length as its last ``start`` or ``resume`` event states it (None: none does)."""
        for e in reversed(self.events):
            if e["event"] in ("start", "resume") and isinstance(e.get("total_steps"), int):
                return e["total_steps"]
        return None

    @property
    def failed(self) -> dict[str, Any] | None:
        """The ``failed`` event when it is the last thing the run wrote (else None)."""
        return self.last if self.last is not None and self.last.get("event") == "failed" else None


def read_run_log(path: Path) -> RunLog:
    """Parse ``path`` (missing or empty: an empty RunLog). Step records keep file order, so a step
    run again after a restart appears twice; the marks say where the run went back."""
    log = RunLog()
    if not path.is_file():
        return log
    pending: list[str] = []  # restart/resume events waiting for the next step record
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            log.bad_lines += 1
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("step"), int):
            log.bad_lines += 1
            continue
        if "event" in obj:
            log.last = obj
            log.events.append(obj)
            if obj["event"] == "restart":
                pending.append(f"restart #{obj.get('restart', '?')} at step {obj['step']}")
            elif obj["event"] == "resume":
                pending.append(f"resumed at step {obj['step']}")
            continue
        if "loss" not in obj:
            log.bad_lines += 1
            continue
        add_record(log, obj, pending)
        log.last, pending = obj, []
    return log


def add_record(log: RunLog, rec: dict[str, Any], pending: list[str]) -> None:
    """Append step record ``rec``, marking a discontinuity before it: the restart/resume events
    since the last record (``pending``), else (a run written without events, by an older dhp) a
    step that is not after the one before, or a first step > 1."""
    i = len(log.records)
    if pending:
        log.marks.append(Mark(i, rec["step"], "; ".join(pending)))
    elif i == 0 and rec["step"] > 1:
        log.marks.append(Mark(0, rec["step"], f"resumed at step {rec['step'] - 1}"))
    elif i and rec["step"] <= log.records[-1]["step"]:
        log.marks.append(Mark(i, rec["step"], f"restart: step {log.records[-1]['step']} -> {rec['step']}"))
    log.records.append(rec)
