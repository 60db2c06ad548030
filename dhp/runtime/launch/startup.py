"""Where a run's start-up goes: process start to the first optimizer step, phase by phase.

The driver marks each phase as it ends (:meth:`Startup.mark`); ``dhp train`` prints the breakdown
after the run summary and writes it to ``<run_dir>/startup.json``. Phases: this process's Python
imports and config (from the process's own start, read from /proc on Linux), the plan, Ray's start,
the placement groups, the actors' start (a process per rank and its imports), the process groups
(and the hand-off channel), build (modules, weight load, parallelism, optimizer), resume, and the
first step's own time.

:func:`connect_ray_importing` cuts the driver's share: ``ray.init`` spends its seconds waiting on the
processes it starts (GCS, raylet, Ray's agents), so the driver's heavy imports (torch.distributed,
transformers' model code, the worker module) run in a thread beside it instead of before it. The
driver's path to that point loads no transformers model code (tests/unit/runtime/test_startup_imports.py).
"""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from dhp.ray_connect import connect_ray as _connect
from dhp.runtime.launch import forkserver
from dhp.runtime.launch.reaper import start_for_local_ray

#: what the driver imports once Ray is starting: the runtime, the worker and the families' model code
RUNTIME_MODULES = (
    "dhp.runtime.loop.driver",
    "dhp.runtime.loop.checkpointing",
    "dhp.data",
    "dhp.runtime.loop.progress",
)

_FIRST_RUN = True  # this process has not started a run yet


def connect_ray(*, cluster: Any, plan: Any) -> bool:
    """:func:`dhp.ray_connect.connect_ray` with a local instance sized to the plan's bundles (a
    SIGKILLed driver's local Ray processes go within seconds, not minutes: dhp.runtime.launch.reaper).
    True when this call initialised Ray (the caller shuts it down)."""
    need = plan.resources if plan is not None else {}

    def local_started() -> None:
        start_for_local_ray()
        forkserver.use_for_local_ray()  # this node's ranks fork from the pre-imported server

    owns = _connect(cluster=cluster, resources=need, on_local_start=local_started)
    server = forkserver.current()
    if server is not None and not server.serving:  # a joined cluster: its nodes start ranks themselves
        server.close()
    return owns


def connect_ray_importing(*, cluster: Any, plan: Any, modules: Sequence[str] = RUNTIME_MODULES) -> bool:
    """:func:`connect_ray` while a thread imports ``modules``; returns when both are done.

    Python imports hold the GIL, ``ray.init`` mostly waits on its child processes: the two overlap.
    ``ray.init`` stays on the calling (main) thread, where Ray installs and dhp restores the signal
    handlers. An import that fails in the thread is left to the caller's own import of that module,
    which raises its error where it belongs. Placements, devices and a joined cluster
    (``cluster.ray_address``) are exactly :func:`connect_ray`'s.
    """
    # the one module both ray.init and these imports load lazily (Ray 2.60): loaded here first, so
    # the two threads never wait on each other's module locks
    importlib.import_module("ctypes.util")
    thread = threading.Thread(target=_import_all, args=(tuple(modules),), name="dhp-imports", daemon=True)
    thread.start()
    try:
        return connect_ray(cluster=cluster, plan=plan)
    finally:
        thread.join()


def _import_all(modules: tuple[str, ...]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException:  # the caller's own import of it raises the error (see above)
            return


def actors_phase(starts: Sequence[str]) -> str:
    """The start-up line of the actors' phase, saying how the rank processes began (``starts``: one
    :meth:`DistWorker.started` verdict per rank)."""
    n = len(starts)
    forked = sum(1 for how in starts if how == "forked")
    misses = sorted({how.split(": ", 1)[1] for how in starts if how.startswith("fresh: ")})
    if n and forked == n:
        return f"actors start ({n} ranks forked from the pre-imported fork server)"
    if not misses:
        return "actors start (a process per rank, its imports)"
    return f"actors start ({forked} of {n} ranks forked; the others imported everything: {'; '.join(misses)})"


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
