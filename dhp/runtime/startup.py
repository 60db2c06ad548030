"""Where a run's start-up goes: process start to the first optimizer step, phase by phase.

The driver marks each phase as it ends (:meth:`Startup.mark`); ``dhp train`` prints the breakdown
after the run summary and writes it to ``<run_dir>/startup.json``. Phases: this process's Python
imports and config (from the process's own start, read from /proc on Linux), the plan, Ray's start,
the placement groups, the actors' start (a process per rank and its imports), the process groups
(and the hand-off channel), build (modules, weight load, parallelism, optimizer), resume, and the
first step's own time.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table

_FIRST_RUN = True  # this process has not started a run yet


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), None where that cannot be read."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start)


@dataclass
class Startup:
    """Phase durations in order; each :meth:`mark` closes the phase that began at the last one."""

    phases: list[tuple[str, float]] = field(default_factory=list)
    _last: float = field(default_factory=time.perf_counter)

    @classmethod
    def from_process_start(cls) -> Startup:
        """A timeline whose first phase is everything this process did before now; from the second
        run of one process on (a sweep), that time belongs to the earlier runs and is left out."""
        global _FIRST_RUN
        out = cls()
        age = process_age_s() if _FIRST_RUN else None
        _FIRST_RUN = False
        if age is not None:
            out.phases.append(("imports + config (this process)", age))
        return out

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases.append((phase, now - self._last))
        self._last = now

    def add(self, phase: str, seconds: float) -> None:
        """A phase timed elsewhere (the first step's own wall time)."""
        self.phases.append((phase, seconds))

    @property
    def total_s(self) -> float:
        return sum(s for _, s in self.phases)

    def write(self, path: Path) -> None:
        data = {"phases": [{"phase": p, "seconds": round(s, 4)} for p, s in self.phases]}
        path.write_text(json.dumps({**data, "total_s": round(self.total_s, 4)}, indent=1))

    def render(self, console) -> None:

        table = Table(title=f"start-up: {self.total_s:.1f} s to the end of step 1")
        table.add_column("phase")
        table.add_column("seconds", justify="right")
        table.add_column("share", justify="right")
        total = max(self.total_s, 1e-9)
        for phase, s in self.phases:
            table.add_row(phase, f"{s:.2f}", f"{100 * s / total:.0f}%")
        console.print(table)
