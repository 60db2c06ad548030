"""``dhp train``: the training loop around the driver step, the run directory, metrics, checkpoints.

Run directory (DESIGN.md): ``<train.output_dir>/<name>/<YYYYmmdd-HHMMSS>/`` with ``config.yaml``,
``plan.json``, ``metrics.jsonl``, ``checkpoints/step_XXXXXX/{<module>/, meta.json}`` and ``tb/``
when ``train.tensorboard``. Failures: a dead or failed actor, a hang or a non-finite step raise
RuntimeFailure naming module, rank and the last good checkpoint; Ctrl-C saves a checkpoint when
``train.save_on_interrupt`` and always shuts Ray down (no orphan processes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console

from dhp.config.schema import RunConfig
from dhp.errors import RuntimeFailure
from dhp.runtime.schedule import WarmupCosine


@dataclass
class RunResult:
    """What a finished (or interrupted) run produced."""

    run_dir: Path
    losses: dict[int, float] = field(default_factory=dict)
    last_checkpoint: Path | None = None
    interrupted: bool = False


def make_run_dir(*, output_dir: str, name: str) -> Path:
    """A fresh ``<output_dir>/<name>/<timestamp>`` (a suffix keeps two runs in one second apart)."""
    base = Path(output_dir) / name / time.strftime("%Y%m%d-%H%M%S")
    run_dir, i = base, 1
    while run_dir.exists():
        run_dir, i = base.with_name(f"{base.name}-{i}"), i + 1
    run_dir.mkdir(parents=True)
    return run_dir


def train(config: RunConfig, *, console: Console | None = None) -> RunResult:
    """Train ``config`` to ``train.steps`` (resuming per ``train.resume``); returns the RunResult."""
    from dhp.checkpoint import resolve_resume
    from dhp.data import build_run_loader
    from dhp.plan import compile_plan
    from dhp.runtime.driver import Trainer
    from dhp.runtime.progress import TrainProgress

    console = console or Console()
    t = config.train
    plan = compile_plan(config)
    resume = resolve_resume(t.resume, output_dir=t.output_dir, name=config.name)
    checked = _check_resume(resume, config=config, plan=plan)  # refuse before any actor or run dir
    run_dir = make_run_dir(output_dir=t.output_dir, name=config.name)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(config, resolve=True))
    (run_dir / "plan.json").write_text(plan.to_json_str())
    loader = build_run_loader(config)
    schedule = WarmupCosine(
        lr=t.lr, warmup_steps=t.warmup_steps, total_steps=t.steps, min_lr_ratio=t.min_lr_ratio
    )
    result = RunResult(run_dir=run_dir, last_checkpoint=resume)
    console.print(f"[bold]dhp train[/] {config.name}: run dir {run_dir}")
    trainer = Trainer(config, plan)
    loop: _Loop | None = None
    graceful = True
    try:
        start = _resume(trainer, resume, checked, loader=loader, schedule=schedule, console=console)
        loop = _Loop(
            config=config,
            plan=plan,
            trainer=trainer,
            loader=loader,
            schedule=schedule,
            run_dir=run_dir,
            result=result,
            resumed_from=resume,
        )
        with TrainProgress(console=console, total=t.steps, start=start) as progress:
            loop.run(start=start, progress=progress)
        progress.summary(result, loop.records)
    except KeyboardInterrupt:
        result.interrupted = True
        step = None if loop is None else loop.settle_interrupted_step()
        if t.save_on_interrupt and step is not None and step > 0:
            result.last_checkpoint = _save(
                trainer,
                config=config,
                plan=plan,
                step=step,
                loader=loader,
                schedule=schedule,
                run_dir=run_dir,
            )
            console.print(f"interrupted after step {step}: saved {result.last_checkpoint}")
        else:
            console.print(
                f"interrupted after step {step}: nothing saved (train.save_on_interrupt={t.save_on_interrupt})"
            )
    except RuntimeFailure as e:
        graceful = False
        last = result.last_checkpoint
        hint = (
            f"last good checkpoint: {last} (resume with train.resume=auto)"
            if last
            else "no checkpoint was written yet"
        )
        raise RuntimeFailure(f"{e}\n  {hint}") from e
    finally:
        trainer.close(graceful=graceful)
    return result


def _check_resume(resume, *, config, plan) -> tuple[Any, list[str]] | None:
    """``(meta, notes)`` of a compatible checkpoint, CheckpointError naming every difference
    otherwise; pure (reads meta.json only), so a refused resume starts no Ray and writes nothing."""
    if resume is None:
        return None
    from dhp.checkpoint import check_resume_compatible, read_meta
    from dhp.checkpoint.compat import model_arch_hash

    meta = read_meta(resume)
    notes = check_resume_compatible(
        meta, plan=plan.to_json(), modules=dict(config.modules), model_hash=model_arch_hash(config.model)
    )
    return meta, notes


def _resume(trainer, resume, checked, *, loader, schedule, console) -> int:
    """Load ``resume`` (if any, checked by ``_check_resume``) into the groups, the loader, the LR
    schedule and the driver RNG."""
    if resume is None:
        return 0
    from dhp.checkpoint import restore_rng_state

    meta, notes = checked
    trainer.load_modules(str(resume))
    loader.load_state_dict(meta.data_state)
    if meta.scheduler_state is not None:
        schedule.load_state_dict(meta.scheduler_state)
    restore_rng_state(meta.driver_rng)
    for n in notes:
        console.print(f"[yellow]resume:[/] {n}")
    console.print(f"resumed from {resume} at step {meta.step}")
    return meta.step


def _save(trainer, *, config, plan, step, loader, schedule, run_dir) -> Path:
    """Write ``checkpoints/step_XXXXXX`` atomically: groups save into a temp dir, then meta + rename."""
    from dhp.checkpoint import (
        CheckpointMeta,
        begin_checkpoint,
        capture_rng_state,
        commit_checkpoint,
        stable_hash,
    )
    from dhp.checkpoint.compat import model_arch_hash, module_records

    tmp = begin_checkpoint(run_dir / "checkpoints", step=step)
    trainer.save_modules(str(tmp))
    meta = CheckpointMeta(
        step=step,
        data_state=loader.state_dict(),
        driver_rng=capture_rng_state(),
        plan=plan.to_json(),
        config_hash=stable_hash(config),
        model_hash=model_arch_hash(config.model),
        modules=module_records(config.modules, world_sizes={g.name: g.world_size for g in plan.groups}),
        scheduler_state=schedule.state_dict(),
    )
    return commit_checkpoint(tmp, meta=meta, keep_last=config.train.keep_last)


class _Loop:
    """The step loop: data -> lr -> driver step -> metrics -> checkpoint."""

    def __init__(
        self, *, config, plan, trainer, loader, schedule, run_dir: Path, result: RunResult, resumed_from=None
    ) -> None:
        from dhp.metrics import MetricsWriter
        from dhp.metrics.loggers import open_loggers

        self.config, self.plan, self.trainer = config, plan, trainer
        self.loader, self.schedule, self.run_dir, self.result = loader, schedule, run_dir, result
        t = config.train
        loggers = open_loggers(  # metrics.loggers; train.tensorboard=true still adds TensorBoard
            config.metrics,
            tensorboard=t.tensorboard,
            run_dir=run_dir,
            name=config.name,
            config=OmegaConf.to_container(OmegaConf.create(config), resolve=True),
            resumed_from=resumed_from,
        )
        self.writer = MetricsWriter(run_dir / "metrics.jsonl", modules=list(config.modules), loggers=loggers)
        self.records: list[dict[str, Any]] = []
        self.done_step: int | None = None
        self._before: tuple[dict, dict] | None = None
        self._running: int | None = None
        self.devices = len({r.global_gpu for g in plan.groups for r in g.ranks})

    def run(self, *, start: int, progress) -> None:
        from dhp.metrics.record import build_record

        t = self.config.train
        try:
            self.done_step = start
            for step in range(start + 1, t.steps + 1):
                self._before = (self.loader.state_dict(), self.schedule.state_dict())
                self._running = step
                data = next(self.loader)
                lr = self.schedule.next_lr()
                res = self.trainer.step(data, lr=lr)
                self.done_step, self._running = step, None
                self.result.losses[step] = res.loss
                rec = build_record(
                    step=step,
                    result=res,
                    data=data,
                    lr=lr,
                    model=self.config.model,
                    modules=dict(self.config.modules),
                    cluster=self.config.cluster,
                    world_devices=self.devices,
                )
                self.records.append(rec)
                if step % t.log_every == 0 or step == t.steps:
                    self.writer.write(rec)
                progress.update(step=step, record=rec)
                if (t.checkpoint_every and step % t.checkpoint_every == 0) or step == t.steps:
                    self.result.last_checkpoint = _save(
                        self.trainer,
                        config=self.config,
                        plan=self.plan,
                        step=step,
                        loader=self.loader,
                        schedule=self.schedule,
                        run_dir=self.run_dir,
                    )
        finally:
            self.writer.close()

    def settle_interrupted_step(self) -> int | None:
        """After Ctrl-C: finish an update already issued (that step counts), or drop the half-run
        step's gradients and rewind the loader and LR schedule to before it. Returns the last done step."""
        running, self._running = self._running, None
        if running is None:
            return self.done_step
        if self.trainer.finish_update():
            self.done_step = running
            return running
        self.trainer.abort_step()
        if self._before is not None:
            self.loader.load_state_dict(self._before[0])
            self.schedule.load_state_dict(self._before[1])
        return self.done_step
