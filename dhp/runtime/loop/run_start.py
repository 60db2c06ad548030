"""The start of a ``dhp train`` run, up to its first attempt, and the record of a run that fails.

Order (``dhp.runtime.loop.train.train``): everything that can refuse the run is built first, the run
directory only after it, so a config or data error leaves no run directory behind:

1. :func:`open_run_data`: the training loader and the eval batches (files opened, tokenizer and
   chat template loaded and checked), the run's length (``train.steps`` or ``train.epochs``,
   :mod:`dhp.runtime.loop.run_length`) and a resume's LR horizon (:mod:`dhp.runtime.loop.horizon`);
2. :func:`start_run_dir`: a new run directory or the resumed one, its ``config.yaml``, ``plan.json``
   and the events that say how the run begins (``start`` for a run by epochs or with a changed
   horizon, ``resume`` for a continued run directory).

:func:`record_failure`: whatever ends a run after its directory exists (a bad sample under
``data.on_bad_sample=raise``, a checkpoint error, a bug) appends its traceback to ``traceback.txt``
and a ``failed`` event to ``metrics.jsonl``, so ``dhp runs`` lists the run as failed with its reason.
Driver side; nothing here touches a device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console
from rich.markup import escape

import dhp.data
from dhp.config.schema import RunConfig
from dhp.errors import ConfigError, ConfigIssue, DhpError
from dhp.metrics.writer import append_event
from dhp.runtime.actors.failures import FailureLog, failed_event
from dhp.runtime.loop.horizon import HorizonChange, horizon_change
from dhp.runtime.loop.run_length import RunLength, run_length
from dhp.runtime.loop.rundirs import FORK, continued_run_dir, resume_event
from dhp.runtime.loop.schedule import Schedule, make_schedule


@dataclass
class RunData:
    """What the run reads, opened before its run directory exists (see the module docstring)."""

    loader: Any  # the first attempt's StepLoader (None once taken: a restart builds its own)
    evals: Any  # dhp.data.eval_batches.EvalBatches, or None without data.eval
    length: RunLength
    horizon: HorizonChange | None  # a resume's horizon that differs from the run's

    def take_loader(self) -> Any:
        """The loader built before the run started, once; later attempts get None."""
        loader, self.loader = self.loader, None
        return loader

    def schedule(self, train: Any) -> Schedule:
        """A fresh LR schedule over the run's length (``train.lr_schedule``)."""
        return make_schedule(train, total_steps=self.length.steps, warmup_steps=self.length.warmup_steps)


def open_run_data(config: RunConfig, plan: Any, checked: tuple[Any, list[str]] | None) -> RunData:
    """Open the run's data (``dhp.data.build_run_data``), count its steps, and compare a resume's
    LR horizon with the run's (``checked``: the checkpoint's meta and notes, or None)."""
    loader, evals = dhp.data.build_run_data(config, plan.layouts)
    t = config.train
    length = run_length(t, samples_per_epoch=loader.epoch_len)
    schedule = make_schedule(t, total_steps=length.steps, warmup_steps=length.warmup_steps)
    saved = None if checked is None else checked[0].scheduler_state
    return RunData(
        loader=loader,
        evals=evals,
        length=length,
        horizon=horizon_change(saved, schedule, mode=t.resume_horizon),
    )


def start_run_dir(
    config: RunConfig, plan: Any, *, resume: Path | None, checked: Any, data: RunData, console: Console
) -> Path:
    """The run directory (a new one, or the resumed run's own), with ``config.yaml``, ``plan.json``
    and the events of how the run begins; says on the console where the run writes, its length and
    a changed LR horizon."""
    t = config.train
    fork = t.resume == FORK
    run_dir = None if fork else continued_run_dir(resume, output_dir=t.output_dir, name=config.name)
    begins = data.length.record()
    if data.horizon is not None:
        begins["lr_horizon"] = data.horizon.record()
    if run_dir is None:
        run_dir = _make_run_dir_or_fail(config)
        console.print(f"[bold]dhp train[/] {config.name}: run dir {run_dir}")
        if data.length.epochs or data.horizon is not None:  # dhp runs reads an epochs run's length here
            append_event(
                run_dir / "metrics.jsonl", {"event": "start", "step": 0, "time": time.time(), **begins}
            )
    else:
        append_event(run_dir / "metrics.jsonl", {**resume_event(resume, step=checked[0].step), **begins})
        console.print(f"[bold]dhp train[/] {config.name}: continuing run dir {run_dir} (from {resume.name})")
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(config, resolve=True))
    (run_dir / "plan.json").write_text(plan.to_json_str())
    console.print(escape(data.length.describe()))
    if data.horizon is not None:
        console.print(f"[yellow]resume:[/] {escape(data.horizon.line())}")
    return run_dir


def make_run_dir(*, output_dir: str, name: str) -> Path:
    """A fresh ``<output_dir>/<name>/<timestamp>`` (a suffix keeps two runs in one second apart)."""
    base = Path(output_dir) / name / time.strftime("%Y%m%d-%H%M%S")
    run_dir, i = base, 1
    while run_dir.exists():
        run_dir, i = base.with_name(f"{base.name}-{i}"), i + 1
    run_dir.mkdir(parents=True)
    return run_dir


def _make_run_dir_or_fail(config: RunConfig) -> Path:
    try:
        return make_run_dir(output_dir=config.train.output_dir, name=config.name)
    except OSError as e:
        raise ConfigError(
            [
                ConfigIssue(
                    path="train.output_dir",
                    value=config.train.output_dir,
                    rule=f"cannot create the run directory ({e.strerror or e})",
                    fix="choose a writable directory with free space, e.g. train.output_dir=$HOME/runs",
                )
            ]
        ) from e


def record_failure(
    e: BaseException,
    *,
    why: str,
    run_dir: Path,
    failures: FailureLog,
    attempt: int,
    step: int,
    console: Console,
) -> Path:
    """Write ``e``'s traceback and the ``failed`` event of a run that ends on it (``why``: the
    supervisor's reason, ``dhp.runtime.loop.supervisor.Supervisor.on_error``); returns the traceback
    file. An exception that is no DhpError is a bug in dhp (its traceback is noted on ``e``)."""
    path = failures.write(e, attempt=attempt, step=step, verdict=f"run ended: {why}")
    append_event(run_dir / "metrics.jsonl", failed_event(e, step=step, why=why, path=path))
    if not isinstance(e, DhpError):
        e.add_note(f"traceback: {path}")
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    console.print(
        f"[red]run failed at step {step}[/]: {escape(first)}\n  recorded in {run_dir / 'metrics.jsonl'} "
        f"(failed) and {escape(str(path))}",
        soft_wrap=True,
    )
    return path
