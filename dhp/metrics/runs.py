"""``dhp runs``: the runs under an output directory, one row each, read from their run directories.

A run directory is ``<root>/<name>/<timestamp>/`` holding ``config.yaml``. Its status comes from what
it wrote: ``finished`` (a checkpoint at ``train.steps``, the end-of-run save), ``active`` (metrics
written in the last ``ACTIVE_S`` seconds and not finished), ``stopped`` (steps logged, not finished:
interrupted, failed or killed; resume with ``train.resume=auto``) or ``empty`` (no step logged).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from dhp.checkpoint.layout import list_checkpoints

ACTIVE_S = 120.0


@dataclass(frozen=True)
class RunInfo:
    """What one run directory shows about its run."""

    run_dir: Path
    name: str
    status: str
    steps: int  # the last logged step
    target_steps: int  # train.steps
    last_loss: float | None
    checkpoints: tuple[int, ...]  # steps of the complete checkpoints
    trackers: tuple[str, ...]  # wandb / mlflow, from trackers.json
    skipped: int = 0  # bad samples skipped (data.on_bad_sample=skip), each named in bad_samples.jsonl


def _last_record(path: Path) -> dict | None:
    if not path.is_file():
        return None
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    for ln in reversed(lines):
        try:
            return json.loads(ln)
        except json.JSONDecodeError:  # a line cut short by a kill: use the one before
            continue
    return None


def read_run(run_dir: Path, *, now: float | None = None) -> RunInfo:
    """Summarise one run directory (it must hold ``config.yaml``)."""
    cfg = OmegaConf.load(run_dir / "config.yaml")
    target = int(cfg.train.steps)
    metrics = run_dir / "metrics.jsonl"
    last = _last_record(metrics)
    ckpts = tuple(step for step, _ in list_checkpoints(run_dir / "checkpoints"))
    trackers_file = run_dir / "trackers.json"
    trackers = tuple(sorted(json.loads(trackers_file.read_text()))) if trackers_file.is_file() else ()
    steps = int(last["step"]) if last else 0
    if ckpts and ckpts[-1] >= target:
        status = "finished"
    elif last and (now or time.time()) - metrics.stat().st_mtime < ACTIVE_S:
        status = "active"
    elif last:
        status = "stopped"
    else:
        status = "empty"
    return RunInfo(
        run_dir=run_dir,
        name=str(cfg.name),
        status=status,
        steps=steps,
        target_steps=target,
        last_loss=float(last["loss"]) if last else None,
        checkpoints=ckpts,
        trackers=trackers,
        skipped=count_skipped(run_dir),
    )


def count_skipped(run_dir: Path) -> int:
    """Skipped bad samples the run named in ``<run_dir>/bad_samples.jsonl`` (0 without the file)."""
    path = run_dir / "bad_samples.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip())


def list_runs(root: Path) -> list[RunInfo]:
    """Every run directory ``<root>/<name>/<timestamp>/`` (with ``config.yaml``), oldest first."""
    dirs = sorted(p.parent for p in Path(root).glob("*/*/config.yaml"))
    return sorted((read_run(d) for d in dirs), key=lambda r: r.run_dir.name)


def render_runs(runs: list[RunInfo], *, console: Console, root: Path) -> None:
    """One table row per run."""
    if not runs:
        console.print(f"no runs under {root} (a run directory is <root>/<name>/<timestamp>/config.yaml)")
        return
    table = Table(title=f"runs under {root} (run directories {root}/<name>/<started>)")
    for col in ("run", "status", "steps", "last loss", "checkpoints", "trackers"):
        table.add_column(
            col, justify="right" if col in ("steps", "last loss") else "left", no_wrap=col == "run"
        )
    colour = {"finished": "green", "active": "cyan", "stopped": "yellow", "empty": "dim"}
    for r in runs:
        ck = ", ".join(str(s) for s in r.checkpoints) if r.checkpoints else "-"
        table.add_row(
            f"{r.run_dir.parent.name}/{r.run_dir.name}",
            f"[{colour[r.status]}]{r.status}[/]",
            f"{r.steps}/{r.target_steps}",
            "-" if r.last_loss is None else f"{r.last_loss:.4f}",
            ck,
            ", ".join(r.trackers) or "-",
        )
    console.print(table)
    for r in runs:
        if r.skipped:
            console.print(
                f"{r.run_dir.parent.name}/{r.run_dir.name}: {r.skipped} bad sample(s) skipped, "
                f"each named in {r.run_dir / 'bad_samples.jsonl'}",
                soft_wrap=True,
            )
