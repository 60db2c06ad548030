"""``dhp runs``: the runs under an output directory, one row each, read from their run directories.

A run directory is ``<root>/<name>/<timestamp>/`` holding ``config.yaml``. Its status comes from what
it wrote: ``finished`` (a checkpoint at the run's last step: ``train.steps``, or for a run by
``train.epochs`` the ``total_steps`` of its start/resume events), ``active`` (metrics
written in the last ``ACTIVE_S`` seconds and not finished), ``failed`` (the run ended on an error it
recorded: its reason and ``traceback.txt`` are in the note), ``stopped`` (steps or events logged,
not finished: interrupted or killed; resume with ``train.resume=auto``) or ``empty`` (nothing logged).
Every state a run directory can be in is read (``dhp.metrics.rundir``): none is an error.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dhp.checkpoint.layout import list_checkpoints
from dhp.metrics.rundir import read_run_log

ACTIVE_S = 120.0
_STARTED = re.compile(r"\d{8}-\d{6}(-\d+)?")


@dataclass(frozen=True)
class RunInfo:
    """What one run directory shows about its run."""

    run_dir: Path
    name: str
    status: str
    steps: int  # the last logged step
    target_steps: int | None  # train.steps, or what train.epochs made (None: not known)
    last_loss: float | None
    checkpoints: tuple[int, ...]  # steps of the complete checkpoints
    trackers: tuple[str, ...]  # wandb / mlflow, from trackers.json
    note: str = ""  # what else a reader should know (why it failed, lines cut short, ...)
    skipped: int = 0  # bad samples skipped (data.on_bad_sample=skip), each named in bad_samples.jsonl


def _target_steps(run_dir: Path) -> tuple[str | None, int | None, str]:
    """``(name, train.steps, problem)`` from ``config.yaml``, whatever state it is in."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None, None, "no config.yaml"
    try:
        cfg = OmegaConf.load(path)
        name = OmegaConf.select(cfg, "name", default=None)
        steps = OmegaConf.select(cfg, "train.steps", default=None)
        return (None if name is None else str(name)), (None if steps is None else int(steps)), ""
    except Exception as e:  # a config.yaml cut short, or not a mapping: still list the run
        return None, None, f"config.yaml unreadable ({type(e).__name__})"


def _trackers(run_dir: Path) -> tuple[str, ...]:
    path = run_dir / "trackers.json"
    try:
        return tuple(sorted(json.loads(path.read_text()))) if path.is_file() else ()
    except (json.JSONDecodeError, TypeError):
        return ()


def read_run(run_dir: Path, *, now: float | None = None) -> RunInfo:
    """Summarise one run directory, in any state a run can leave it (see ``dhp.metrics.rundir``)."""
    name, target, problem = _target_steps(run_dir)
    metrics = run_dir / "metrics.jsonl"
    log = read_run_log(metrics)
    if target == 0:  # a run by train.epochs: its step count is in its start/resume events
        target = log.total_steps
    last = log.records[-1] if log.records else None
    ckpts = tuple(step for step, _ in list_checkpoints(run_dir / "checkpoints"))
    notes = [problem] if problem else []
    if log.bad_lines:
        notes.append(f"{log.bad_lines} unreadable line(s) in metrics.jsonl")
    if target is not None and ckpts and ckpts[-1] >= target:
        status = "finished"
    elif log.failed is not None:
        status = "failed"
        notes.insert(
            0, f"{log.failed.get('reason', 'failed')} (see {log.failed.get('traceback', 'the console')})"
        )
    elif metrics.is_file() and (now or time.time()) - metrics.stat().st_mtime < ACTIVE_S:
        status = "active"
    elif last or log.events:
        status = "stopped"
    else:
        status = "empty"
    if log.evals:
        notes.append(_eval_note(log.evals))
    restarts = sum(e["event"] == "restart" for e in log.events)
    resumes = sum(e["event"] == "resume" for e in log.events)
    if restarts or resumes:
        notes.append(", ".join(f"{n} {w}(s)" for n, w in ((restarts, "restart"), (resumes, "resume")) if n))
    return RunInfo(
        run_dir=run_dir,
        name=name or run_dir.parent.name,
        status=status,
        steps=int(last["step"]) if last else 0,
        target_steps=target,
        last_loss=float(last["loss"]) if last else None,
        checkpoints=ckpts,
        trackers=_trackers(run_dir),
        note="; ".join(notes),
        skipped=count_skipped(run_dir),
    )


def _eval_note(evals: list[dict]) -> str:
    """``eval 1.2345 at step 40 (best 1.2000 at step 20)``: the last and the lowest eval loss."""
    last = evals[-1]
    best = min(evals, key=lambda e: e["eval_loss"])
    text = f"eval {last['eval_loss']:.4f} at step {last['step']}"
    return text if best is last else f"{text} (best {best['eval_loss']:.4f} at step {best['step']})"


def _is_run_dir(path: Path) -> bool:
    """``<root>/<name>/<timestamp>``: a directory with what a run writes, or an empty one named by
    the run's start time (a run killed right after creating it)."""
    if not path.is_dir() or path.parent.name == "sweeps":
        return False
    if (path / "config.yaml").is_file() or (path / "metrics.jsonl").is_file():
        return True
    return _STARTED.fullmatch(path.name) is not None and not any(path.iterdir())


def count_skipped(run_dir: Path) -> int:
    """Skipped bad samples the run named in ``<run_dir>/bad_samples.jsonl`` (0 without the file)."""
    path = run_dir / "bad_samples.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip())


def list_runs(root: Path) -> list[RunInfo]:
    """Every run directory ``<root>/<name>/<timestamp>/``, oldest first."""
    dirs = sorted(p for p in Path(root).glob("*/*") if _is_run_dir(p))
    return sorted((read_run(d) for d in dirs), key=lambda r: r.run_dir.name)


def render_runs(runs: list[RunInfo], *, console: Console, root: Path) -> None:
    """One table row per run."""
    if not runs:
        console.print(f"no runs under {root} (a run directory is <root>/<name>/<timestamp>/config.yaml)")
        return
    table = Table(title=f"runs under {root} (run directories {root}/<name>/<started>)")
    for col in ("run", "status", "steps", "last loss", "checkpoints", "trackers", "note"):
        table.add_column(
            col,
            justify="right" if col in ("steps", "last loss") else "left",
            no_wrap=col in ("run", "status", "steps"),
            min_width={"status": 8, "steps": 5}.get(col),  # a narrow terminal wraps the note, not these
            overflow="fold" if col == "note" else "ellipsis",
        )
    colour = {"finished": "green", "active": "cyan", "stopped": "yellow", "failed": "red", "empty": "dim"}
    for r in runs:
        ck = ", ".join(str(s) for s in r.checkpoints) if r.checkpoints else "-"
        table.add_row(
            f"{r.run_dir.parent.name}/{r.run_dir.name}",
            f"[{colour[r.status]}]{r.status}[/]",
            f"{r.steps}/{'?' if r.target_steps is None else r.target_steps}",
            "-" if r.last_loss is None else f"{r.last_loss:.4f}",
            ck,
            ", ".join(r.trackers) or "-",
            escape(r.note) or "-",
        )
    console.print(table)
    for r in runs:
        if r.skipped:
            console.print(
                f"{r.run_dir.parent.name}/{r.run_dir.name}: {r.skipped} bad sample(s) skipped, "
                f"each named in {r.run_dir / 'bad_samples.jsonl'}",
                soft_wrap=True,
            )
