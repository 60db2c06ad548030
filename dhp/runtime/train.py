"""``dhp train``: the training loop around the driver step, the run directory, metrics, checkpoints.

Run directory: ``<train.output_dir>/<name>/<YYYYmmdd-HHMMSS>/`` (a resumed run continues the one it
resumes: ``dhp.runtime.rundirs``) with ``config.yaml``,
``plan.json``, ``metrics.jsonl``, ``checkpoints/step_XXXXXX/{<module>/, meta.json}`` and ``tb/``
when ``train.tensorboard``. Failures: a dead or failed actor, a hang or a non-finite step raise
RuntimeFailure naming module, rank and the last good checkpoint; Ctrl-C saves a checkpoint when
``train.save_on_interrupt`` and always shuts Ray down (no orphan processes).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console
from rich.markup import escape

import dhp.data
from dhp.config.schema import RunConfig, TrainConfig
from dhp.errors import DhpError, RuntimeFailure
from dhp.metrics.writer import append_event
from dhp.models.registry import family_package
from dhp.models.tiny_cache import ensure_tiny_checkpoint
from dhp.runtime.failures import FailureLog, failed_event
from dhp.runtime.rundirs import FORK, continued_run_dir, resume_event
from dhp.runtime.schedule import WarmupCosine
from dhp.runtime.startup import RUNTIME_MODULES, Startup, connect_ray_importing


@dataclass
class RunResult:
    """What a finished (or interrupted) run produced."""

    run_dir: Path
    losses: dict[int, float] = field(default_factory=dict)
    last_checkpoint: Path | None = None
    interrupted: bool = False
    signal: int | None = None  # the signal that stopped the run (SIGINT, SIGTERM), if any
    restarts: int = 0
    startup: Startup = field(default_factory=Startup)  # the first attempt's phases (dhp.runtime.startup)


def make_run_dir(*, output_dir: str, name: str) -> Path:
    """A fresh ``<output_dir>/<name>/<timestamp>`` (a suffix keeps two runs in one second apart)."""
    base = Path(output_dir) / name / time.strftime("%Y%m%d-%H%M%S")
    run_dir, i = base, 1
    while run_dir.exists():
        run_dir, i = base.with_name(f"{base.name}-{i}"), i + 1
    run_dir.mkdir(parents=True)
    return run_dir


def train(config: RunConfig, *, console: Console | None = None) -> RunResult:
    """Train ``config`` to ``train.steps`` (resuming per ``train.resume``); returns the RunResult.

    ``train.resume=auto`` continues the run directory of the checkpoint it resumes (metrics.jsonl
    gets a ``resume`` event, the trackers continue their runs); ``fork`` resumes the same checkpoint
    into a new run directory; a checkpoint PATH of another run starts a new run directory from it.

    A dead actor, node or collective, or a step timeout, restarts the whole run from the newest
    checkpoint of this run dir that verifies (at most ``train.max_restarts`` times). SIGTERM is the
    first Ctrl-C: checkpoint at the step boundary, ``result.signal`` set (the CLI exits 128+signal).
    """
    from dhp.checkpoint import remove_stale_temps, resolve_resume

    console = console or Console()
    startup = Startup.from_process_start()
    from dhp.metrics.tracker_check import check_trackers

    check_trackers(config.metrics)  # before a run dir, Ray or a tracker run exists
    ensure_tiny_checkpoint(config.model, say=lambda line: console.print(escape(line)))  # before any reader
    t = config.train
    for p in remove_stale_temps(t.output_dir, name=config.name):
        console.print(f"removed a stale temp checkpoint dir left by a crashed save: {escape(str(p))}")

    def skipped(path: Path, problems: list[str]) -> None:
        console.print(f"[yellow]resume=auto: skipped {escape(str(path))}[/]: " + escape("; ".join(problems)))

    plan = _compile(config)
    fork = t.resume == FORK
    resume = resolve_resume(
        "auto" if fork else t.resume, output_dir=t.output_dir, name=config.name, on_skip=skipped
    )
    checked = _check_resume(resume, config=config, plan=plan)  # refuse before any actor or run dir
    run_dir = None if fork else continued_run_dir(resume, output_dir=t.output_dir, name=config.name)
    if run_dir is None:
        run_dir = _make_run_dir_or_fail(config)
        console.print(f"[bold]dhp train[/] {config.name}: run dir {run_dir}")
    else:
        append_event(run_dir / "metrics.jsonl", resume_event(resume, step=checked[0].step))
        console.print(f"[bold]dhp train[/] {config.name}: continuing run dir {run_dir} (from {resume.name})")
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(config, resolve=True))
    (run_dir / "plan.json").write_text(plan.to_json_str())
    startup.mark("plan + run dir")
    result = RunResult(run_dir=run_dir, last_checkpoint=resume, startup=startup)
    from dhp.checkpoint import capture_rng_state

    initial_rng = capture_rng_state()
    restarts = 0
    failures = FailureLog(run_dir)
    with _signals(result) as sig:
        while True:
            try:
                _attempt(
                    config, plan, resume, checked, result=result, console=console, sig=sig, failures=failures
                )
                return result
            except _Restart as r:
                restarts += 1
                resume = _restart_point(run_dir, console=console, skipped=skipped)
                checked = _check_resume(resume, config=config, plan=plan)
                if resume is None:
                    from dhp.checkpoint import restore_rng_state

                    restore_rng_state(initial_rng)
                _record_restart(run_dir, restarts=restarts, failure=r.failure, resume=resume, console=console)
                time.sleep(t.restart_backoff_s)
            except (KeyboardInterrupt, _HardStop):
                # a signal outside an attempt's own handling (its loader being built, a restart's
                # backoff): nothing is running that could save, so stop with the signal's exit code
                result.interrupted = True
                last = result.last_checkpoint
                console.print(f"interrupted before a step could run; last good checkpoint: {last or 'none'}")
                return result
            except Exception as e:  # a bug in the driver's own code: its traceback goes to the run dir
                if not isinstance(e, DhpError):
                    step = max(result.losses, default=0) + 1
                    path = failures.write(
                        e, attempt=restarts + 1, step=step, verdict="run ended: an error in dhp"
                    )
                    e.add_note(f"traceback: {path}")
                raise


class _Restart(Exception):
    """Internal: the attempt failed with a restartable failure and restarts are left."""

    def __init__(self, failure: RuntimeFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure


class _HardStop(BaseException):
    """A second Ctrl-C or SIGTERM: stop at once, no checkpoint."""


class _Signals:
    """SIGINT/SIGTERM state: the first one raises KeyboardInterrupt (Ctrl-C semantics), later ones
    raise _HardStop."""

    def __init__(self, result: RunResult) -> None:
        self.result, self.count = result, 0

    def handler(self, signum: int, frame) -> None:
        self.count += 1
        if self.result.signal is None:
            self.result.signal = signum
        if self.count == 1:
            raise KeyboardInterrupt
        raise _HardStop

    def reinstall(self) -> None:
        """Take SIGTERM back after ``ray.init`` (Ray's core worker installs a crash handler for it
        that aborts the driver with exit 134)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.handler)


@contextlib.contextmanager
def _signals(result: RunResult):
    """Install the SIGINT/SIGTERM handlers for the run (main thread only); restore them after."""
    sig = _Signals(result)
    if threading.current_thread() is not threading.main_thread():
        yield sig
        return
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, sig.handler)
    if old[signal.SIGINT] is not signal.SIG_IGN:  # a background job keeps ignoring Ctrl-C
        signal.signal(signal.SIGINT, sig.handler)
    try:
        yield sig
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _compile(config: RunConfig):
    from dhp.plan import compile_plan

    return compile_plan(config)


def _make_run_dir_or_fail(config: RunConfig) -> Path:
    from dhp.errors import ConfigError, ConfigIssue

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


def _restart_point(run_dir: Path, *, console: Console, skipped) -> Path | None:
    """The newest checkpoint of this run dir that verifies (None: start over from step 0)."""
    from dhp.checkpoint import checkpoint_candidates, verify_checkpoint

    for p in checkpoint_candidates(output_dir=run_dir.parent.parent, name=run_dir.parent.name):
        if p.parent.parent != run_dir:
            continue
        problems = verify_checkpoint(p)
        if not problems:
            return p
        skipped(p, problems)
    return None


def _record_restart(run_dir: Path, *, restarts: int, failure, resume, console: Console) -> None:
    """One ``{"event": "restart", ...}`` line in metrics.jsonl and a console line."""
    from dhp.checkpoint import read_meta

    rec = {
        "event": "restart",
        "step": read_meta(resume).step if resume else 0,  # the step training continues after
        "restart": restarts,
        "time": time.time(),
        "reason": str(failure).splitlines()[0],
        "resume_from": str(resume) if resume else None,
    }
    append_event(run_dir / "metrics.jsonl", rec)
    where = f"from {resume}" if resume else "from step 0 (no checkpoint yet)"
    console.print(f"[yellow]restart {restarts}[/] after: {escape(rec['reason'])}; resuming {escape(where)}")


def _attempt(
    config, plan, resume, checked, *, result: RunResult, console: Console, sig: _Signals, failures: FailureLog
) -> None:
    """One life of the actor groups: start them, resume, run the loop; on a restartable failure with
    restarts left, tear everything down and raise _Restart."""
    t = config.train
    run_dir = result.run_dir
    clock = result.startup if result.restarts == 0 else Startup()  # a restart's phases are not printed
    loader = dhp.data.build_run_loader(config, plan.layouts)
    loader.record_skipped_to(run_dir / "bad_samples.jsonl")  # every skipped sample, named
    clock.mark("data loader")
    schedule = WarmupCosine(
        lr=t.lr, warmup_steps=t.warmup_steps, total_steps=t.steps, min_lr_ratio=t.min_lr_ratio
    )
    trainer = None
    owns_ray = False
    loop: _Loop | None = None
    saver = None  # checkpoint.async_save: the save in flight (dhp.runtime.checkpointing)
    graceful = True
    try:
        # Ray starts while a thread imports the runtime, worker and model code (dhp.runtime.startup)
        owns_ray = connect_ray_importing(
            cluster=config.cluster,
            plan=plan,
            modules=(*RUNTIME_MODULES, f"{family_package(config.model.family)}.family"),
        )
        clock.mark("Ray start, the driver's imports beside it (runtime, worker, model code)")
        # loaded by connect_ray_importing's thread: the worker's module, transformers' model code
        from dhp.runtime.checkpointing import AsyncCheckpoints
        from dhp.runtime.driver import Trainer
        from dhp.runtime.progress import TrainProgress

        ready = 60.0 if result.restarts == 0 else t.restart_wait_s
        trainer = Trainer(config, plan, ready_timeout_s=ready, startup=clock, owns_ray=owns_ray)
        sig.reinstall()
        if config.checkpoint.async_save:
            saver = AsyncCheckpoints(trainer, config=config, run_dir=run_dir)
        start = _resume(trainer, resume, checked, loader=loader, schedule=schedule, console=console)
        clock.mark("resume")
        loop = _Loop(
            config=config,
            plan=plan,
            trainer=trainer,
            loader=loader,
            schedule=schedule,
            run_dir=run_dir,
            result=result,
            resumed_from=resume,
            saver=saver,
        )
        with TrainProgress(console=console, total=t.steps, start=start) as progress:
            loop.run(start=start, progress=progress)
        progress.summary(result, loop.records)
        if loop.records and clock is result.startup:
            clock.add("step 1 (its own wall time)", loop.records[0]["step_s"])
            clock.render(console)
            clock.write(run_dir / "startup.json")
    except KeyboardInterrupt:
        result.interrupted = True
        if trainer is None:
            return
        try:
            step = None if loop is None else loop.settle_interrupted_step()
            if saver is not None and saver.step is not None:  # the save in flight counts: finish it
                result.last_checkpoint = saver.finish() or result.last_checkpoint
                if result.last_checkpoint is not None and result.last_checkpoint.name == f"step_{step:06d}":
                    step = None  # that save is this step's checkpoint already
                    console.print(f"interrupted: saved {result.last_checkpoint}")
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
        except _HardStop:
            graceful = False
            console.print(f"stopped at once; last good checkpoint: {result.last_checkpoint or 'none'}")
    except _HardStop:
        graceful, result.interrupted = False, True
        console.print(f"stopped at once; last good checkpoint: {result.last_checkpoint or 'none'}")
    except SystemExit as e:
        if e.code != signal.SIGTERM or trainer is not None:
            raise
        # SIGTERM inside ray.init: Ray's own handler (set there, before ours is put back) exits 15
        graceful, result.interrupted = False, True
        result.signal = result.signal or signal.SIGTERM
        console.print("terminated while starting Ray; nothing was trained or saved")
        import ray

        with contextlib.suppress(Exception):
            ray.shutdown()  # whatever that half-done ray.init started
    except RuntimeFailure as e:
        # the worker's module (torch.distributed, transformers): loaded once Ray started, see above
        from dhp.runtime.checkpointing import SaveFailed
        from dhp.runtime.driver import NonFiniteStep

        graceful = False
        step = loop.failing_step() if loop is not None else 0
        why = failures.verdict(e, step=step)
        if why is None and isinstance(e, NonFiniteStep | SaveFailed):
            why = "restarting would not change it"
        if why is None and trainer is None:
            why = "the actor groups did not start"
        attempt = result.restarts + 1
        if why is None and result.restarts < t.max_restarts:
            failures.write(
                e, attempt=attempt, step=step, verdict=f"restarted ({attempt} of {t.max_restarts})"
            )
            result.restarts += 1
            raise _Restart(e) from e
        if why is None:
            why = f"no restart left (after {result.restarts} restart(s), train.max_restarts={t.max_restarts})"
        path = failures.write(e, attempt=attempt, step=step, verdict=f"run ended: {why}")
        append_event(run_dir / "metrics.jsonl", failed_event(e, step=step, why=why, path=path))
        last = result.last_checkpoint
        hint = (
            f"last good checkpoint: {last} (resume with train.resume=auto)"
            if last
            else "no checkpoint was written yet"
        )
        raise RuntimeFailure(f"{e}\n  not restarted: {why}\n  tracebacks: {path}\n  {hint}") from e
    finally:
        if trainer is not None:
            try:
                trainer.close(graceful=graceful)
            except _HardStop:
                trainer.close(graceful=False)
        elif owns_ray:  # Ray started but no trainer took it over (an interrupt, or Trainer failed)
            import ray  # loaded already: Ray started above

            with contextlib.suppress(Exception):
                ray.shutdown()
        if saver is not None:  # a save still in flight never counts: its writers are gone
            saver.abandon()


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


def _meta(*, config, plan, step, loader, schedule):
    """The driver's side of a checkpoint at this step boundary: loader position, driver RNG, LR
    schedule, plan and hashes (``meta.json``)."""
    from dhp.checkpoint import CheckpointMeta, capture_rng_state, stable_hash
    from dhp.checkpoint.compat import model_arch_hash, module_records

    return CheckpointMeta(
        step=step,
        data_state=loader.state_dict(),
        driver_rng=capture_rng_state(),
        plan=plan.to_json(),
        config_hash=stable_hash(config),
        model_hash=model_arch_hash(config.model),
        modules=module_records(config.modules, world_sizes={g.name: g.world_size for g in plan.groups}),
        scheduler_state=schedule.state_dict(),
    )


def _save(trainer, *, config, plan, step, loader, schedule, run_dir) -> Path:
    """Write ``checkpoints/step_XXXXXX`` atomically: groups save into a temp dir, then meta + rename."""
    from dhp.checkpoint import begin_checkpoint, commit_checkpoint

    # loads the worker's module (torch.distributed, transformers): after Ray's start (dhp.runtime.startup)
    from dhp.runtime.checkpointing import is_io_failure, save_failed

    try:
        tmp = begin_checkpoint(run_dir / "checkpoints", step=step)
    except OSError as e:
        raise save_failed(run_dir, step, e) from e
    try:
        trainer.save_modules(str(tmp))
    except BaseException as e:  # a failed or interrupted save leaves no temp dir behind
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) or (isinstance(e, RuntimeFailure) and is_io_failure(str(e))):
            raise save_failed(run_dir, step, e) from e
        raise
    meta = _meta(config=config, plan=plan, step=step, loader=loader, schedule=schedule)
    try:
        return commit_checkpoint(tmp, meta=meta, keep_last=config.train.keep_last)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise save_failed(run_dir, step, e) from e
        raise


class _Loop:
    """The step loop: data -> lr -> driver step -> metrics -> checkpoint."""

    def __init__(
        self,
        *,
        config,
        plan,
        trainer,
        loader,
        schedule,
        run_dir: Path,
        result: RunResult,
        resumed_from=None,
        saver=None,
    ) -> None:
        from dhp.metrics import MetricsWriter
        from dhp.metrics.loggers import open_loggers

        self.config, self.plan, self.trainer = config, plan, trainer
        self.loader, self.schedule, self.run_dir, self.result = loader, schedule, run_dir, result
        self.saver = saver  # AsyncCheckpoints when checkpoint.async_save, else None (synchronous saves)
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
                    base_lr=t.lr,
                    model=self.config.model,
                    modules=dict(self.config.modules),
                    cluster=self.config.cluster,
                    world_devices=self.devices,
                )
                self.records.append(rec)
                if step % t.log_every == 0 or step == t.steps:
                    self.writer.write(rec)
                progress.update(step=step, record=rec)
                if self.saver is not None:
                    self._checkpoint_async(step)
                elif _checkpoint_due(t, step):
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

    def _checkpoint_async(self, step: int) -> None:
        """Commit the save in flight once written; start this step's save when due (the last step's
        is waited for: the run ends with its final checkpoint committed)."""
        t = self.config.train
        done = self.saver.poll()
        if _checkpoint_due(t, step):
            meta = _meta(
                config=self.config, plan=self.plan, step=step, loader=self.loader, schedule=self.schedule
            )
            done = self.saver.start(step=step, meta=meta) or done
            if step == t.steps:
                done = self.saver.finish()
        if done is not None:
            self.result.last_checkpoint = done

    def failing_step(self) -> int:
        """The step a failure interrupted: the one running, else the one after the last done."""
        if self._running is not None:
            return self._running
        return (self.done_step or 0) + 1

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


def _checkpoint_due(train: TrainConfig, step: int) -> bool:
    """A checkpoint is written after ``step``: every ``train.checkpoint_every`` steps (0: never on a
    stride) and always after the last step. The one rule for the synchronous and async savers."""
    return bool(train.checkpoint_every and step % train.checkpoint_every == 0) or step == train.steps
