"""``dhp train``: the training loop around the driver step, the run directory, metrics, checkpoints.

Run directory: ``<train.output_dir>/<name>/<YYYYmmdd-HHMMSS>/`` (a resumed run continues the one it
resumes: ``dhp.runtime.loop.rundirs``) with ``config.yaml``,
``plan.json``, ``metrics.jsonl``, ``checkpoints/step_XXXXXX/{<module>/, meta.json}`` and ``tb/``
when ``train.tensorboard``; it is made only once the data is open (``dhp.runtime.loop.run_start``), so a
config or data error leaves none. The run is ``train.steps`` or ``train.epochs`` long
(``dhp.runtime.loop.run_length``), evaluated on ``data.eval`` every ``train.eval_every`` steps and at the
end (``dhp.runtime.loop.eval_loop``). Failures: a dead or failed actor, a hang or a non-finite step raise
RuntimeFailure naming module, rank and the last good checkpoint (a hang: with every rank's stack in
``traceback.txt``); anything else that ends the run (a bad sample, a bug) is recorded too: its
traceback in ``traceback.txt``, a ``failed`` event in ``metrics.jsonl``. Ctrl-C and SIGTERM never cut a step: the step running ends, the loop saves a
checkpoint at that boundary (``train.save_on_interrupt``) and the run ends with 130 or 143
(``dhp.runtime.loop.interrupts``; a caller with Python's own Ctrl-C handling gets its KeyboardInterrupt
after that stop); Ray is always shut down (no orphan processes).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console
from rich.markup import escape

import dhp.data
from dhp.config.schema import RunConfig, TrainConfig
from dhp.errors import RuntimeFailure
from dhp.metrics.writer import append_event
from dhp.models.registry import family_package
from dhp.models.tiny_cache import ensure_tiny_checkpoint
from dhp.runtime.actors.failures import INFRA, FailureLog, RunFailed, failed_event, failure_kind
from dhp.runtime.actors.stacks import stuck_lines
from dhp.runtime.launch.startup import RUNTIME_MODULES, Startup, connect_ray_importing
from dhp.runtime.loop.eval_loop import EvalLoop
from dhp.runtime.loop.horizon import apply, horizon_change
from dhp.runtime.loop.interrupts import HardStop, Signals, run_signals
from dhp.runtime.loop.run_length import RunLength
from dhp.runtime.loop.run_start import RunData, make_run_dir, open_run_data, record_failure, start_run_dir
from dhp.runtime.loop.rundirs import FORK
from dhp.runtime.loop.supervisor import RESTART, STOP, Decision, Supervisor


@dataclass
class RunResult:
    """What a finished (or interrupted) run produced."""

    run_dir: Path | None  # None only when the run stopped before its data was open
    losses: dict[int, float] = field(default_factory=dict)
    last_checkpoint: Path | None = None
    interrupted: bool = False
    signal: int | None = None  # the signal that stopped the run (SIGINT, SIGTERM), if any
    signal_time: float | None = None  # time.monotonic() when it came
    restarts: int = 0
    startup: Startup = field(
        default_factory=Startup
    )  # the first attempt's phases (dhp.runtime.launch.startup)
    evals: dict[int, float] = field(default_factory=dict)  # step -> eval loss (data.eval)
    length: RunLength | None = None  # the run's steps and warmup, once its data is open


__all__ = ["RunResult", "make_run_dir", "train"]


def train(config: RunConfig, *, console: Console | None = None) -> RunResult:
    """Train ``config`` for ``train.steps`` (or ``train.epochs``), resuming per ``train.resume``;
    returns the RunResult.

    ``train.resume=auto`` continues the run directory of the checkpoint it resumes (metrics.jsonl
    gets a ``resume`` event, the trackers continue their runs); ``fork`` resumes the same checkpoint
    into a new run directory; a checkpoint PATH of another run starts a new run directory from it.

    A dead actor, node or collective, or a step timeout, restarts the whole run from the newest
    checkpoint of this run dir that verifies (at most ``train.max_restarts`` times). SIGTERM is
    Ctrl-C: the step running ends, a checkpoint at that boundary, ``result.signal`` set (the CLI
    exits 128+signal); a second one stops at once (``dhp.runtime.loop.interrupts``). A Ctrl-C whose
    caller had Python's default handler ends in ``RunInterrupted`` after that stop.
    """
    from dhp.checkpoint import capture_rng_state, remove_stale_temps, resolve_resume

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
    resume = resolve_resume(
        "auto" if t.resume == FORK else t.resume, output_dir=t.output_dir, name=config.name, on_skip=skipped
    )
    checked = _check_resume(resume, config=config, plan=plan)  # refuse before any actor or run dir
    result = RunResult(run_dir=None, last_checkpoint=resume, startup=startup)
    initial_rng = capture_rng_state()
    with run_signals(result) as sig:
        try:  # the data before the run dir: a data or config error leaves none behind
            data = open_run_data(config, plan, checked)
        except (KeyboardInterrupt, HardStop):
            return _stopped_early(result, console)
        result.length = data.length
        result.run_dir = start_run_dir(
            config, plan, resume=resume, checked=checked, data=data, console=console
        )
        startup.mark("data, plan + run dir")
        return _attempts(
            config, plan, resume, checked, data=data, result=result, console=console, sig=sig,
            initial_rng=initial_rng, skipped=skipped,
        )  # fmt: skip


def _stopped_early(result: RunResult, console: Console) -> RunResult:
    """A signal outside an attempt's own handling (the data being opened, a restart's backoff):
    nothing is running that could save, so the run stops with the signal's exit code."""
    result.interrupted = True
    last = result.last_checkpoint
    console.print(f"interrupted before a step could run; last good checkpoint: {last or 'none'}")
    return result


def _attempts(
    config, plan, resume, checked, *, data: RunData, result: RunResult, console, sig, initial_rng, skipped
) -> RunResult:
    """The attempts of one run: the first, then one per restart the supervisor decides
    (``dhp.runtime.loop.supervisor``). Whatever else ends the run is recorded in its run dir
    (``dhp.runtime.loop.run_start.record_failure``)."""
    boss = Supervisor(config.train, FailureLog(result.run_dir))
    failed: _Restart | None = None  # the attempt the next one restarts after
    while True:
        try:
            if failed is not None:  # inside the try: a signal in the backoff stops the run
                resume, checked = _restart(
                    config, plan, failed, result=result, console=console, skipped=skipped, initial_rng=initial_rng
                )  # fmt: skip
            _Attempt(
                config, plan, resume, checked, data=data, result=result, console=console, sig=sig, boss=boss
            ).run()  # fmt: skip
            return result
        except _Restart as r:
            signum = result.signal if sig.requested else None
            if boss.before_restart(r.decision, signum=signum).action == STOP:  # a signal in the teardown
                result.interrupted = True
                last = result.last_checkpoint
                console.print(f"interrupted; not restarted; last good checkpoint: {last or 'none'}")
                return result
            failed, sig.mode = r, "raise"  # the backoff and the next start stop at once on a signal
        except (KeyboardInterrupt, HardStop):
            return _stopped_early(result, console)
        except Exception as e:  # a bad sample, a checkpoint error, a bug: the run dir says it failed
            decision = boss.on_error(e)
            if decision.record:
                step = max(result.losses, default=0) + 1
                record_failure(
                    e, why=decision.why, run_dir=result.run_dir, failures=boss.failures, attempt=decision.attempt,
                    step=step, console=console,
                )  # fmt: skip
            raise


class _Restart(Exception):
    """Internal: the attempt failed and the supervisor decided a restart (``decision``)."""

    def __init__(self, failure: RuntimeFailure, decision: Decision) -> None:
        super().__init__(str(failure))
        self.failure = failure
        self.decision = decision


def _restart(config, plan, failed: _Restart, *, result: RunResult, console, skipped, initial_rng):
    """Before a restart: the newest checkpoint of the run dir that verifies (none: step 0, with the
    run's first RNG state), its check, the ``restart`` record, then the supervisor's backoff."""
    resume = _restart_point(result.run_dir, console=console, skipped=skipped)
    checked = _check_resume(resume, config=config, plan=plan)
    if resume is None:
        from dhp.checkpoint import restore_rng_state

        restore_rng_state(initial_rng)
    _record_restart(
        result.run_dir,
        restarts=failed.decision.restart,
        failure=failed.failure,
        resume=resume,
        console=console,
    )
    time.sleep(failed.decision.wait_s)
    return resume, checked


def _compile(config: RunConfig):
    from dhp.plan import compile_plan

    return compile_plan(config)


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


class _Attempt:
    """One life of the actor groups: start them, resume, run the loop; a RuntimeFailure goes to the
    supervisor (``_failed``): _Restart after the teardown, or the RunFailed that ends the run.

    A signal before the loop stops at once (nothing saved); in the loop, the first one ends the loop
    at the next step boundary with a checkpoint (``_Loop.run``), a second one stops at once."""

    def __init__(
        self, config, plan, resume, checked, *, data: RunData, result: RunResult, console: Console,
        sig: Signals, boss: Supervisor,
    ) -> None:  # fmt: skip
        self.config, self.plan, self.resume, self.checked = config, plan, resume, checked
        self.data, self.result, self.console, self.sig, self.boss = data, result, console, sig, boss
        self.trainer = None
        self.owns_ray = False
        self.loop: _Loop | None = None
        self.saver = None  # checkpoint.async_save: the save in flight (dhp.runtime.loop.checkpointing)
        self.graceful = True
        self.stage = "starting Ray"

    def run(self) -> None:
        """The attempt, start to teardown; returns when the run is over (done or stopped)."""
        result, sig = self.result, self.sig
        clock = result.startup if result.restarts == 0 else Startup()  # a restart's phases are not printed
        sig.mode = "raise"
        loader = self.data.take_loader() or dhp.data.build_run_loader(self.config, self.plan.layouts)
        loader.record_skipped_to(result.run_dir / "bad_samples.jsonl")  # every skipped sample, named
        clock.mark("data loader")
        schedule = self.data.schedule(self.config.train)
        try:
            start = self._start(clock, loader=loader, schedule=schedule)
            self._steps(clock, start=start)
        except KeyboardInterrupt:  # a signal before the loop (mode "raise"): nothing ran that could be saved
            last = result.last_checkpoint
            self._stopped(
                f"interrupted while {self.stage}, before a step could run; last good checkpoint: {last or 'none'}"
            )
        except HardStop:
            self._stopped(f"stopped at once; last good checkpoint: {result.last_checkpoint or 'none'}")
        except SystemExit as e:
            self._exited(e)
        except RuntimeFailure as e:
            self.graceful, sig.mode = False, "quiet"  # a signal now: no restart (Supervisor.on_failure)
            self._failed(e)
        finally:
            self._teardown()

    def _start(self, clock: Startup, *, loader, schedule) -> int:
        """Ray, the actor groups, the async saver, the resume and the loop; returns the step
        the loop starts after."""
        config, t, sig = self.config, self.config.train, self.sig
        # Ray starts while a thread imports the runtime, worker and model code (dhp.runtime.launch.startup)
        self.owns_ray = connect_ray_importing(
            cluster=config.cluster,
            plan=self.plan,
            modules=(*RUNTIME_MODULES, f"{family_package(config.model.family)}.family"),
        )
        sig.reinstall()
        clock.mark("Ray start, the driver's imports beside it (runtime, worker, model code)")
        # loaded by connect_ray_importing's thread: the worker's module, transformers' model code
        from dhp.runtime.loop.checkpointing import AsyncCheckpoints
        from dhp.runtime.loop.driver import Trainer

        self.stage = "starting and building the actor groups"
        ready = 60.0 if self.result.restarts == 0 else t.restart_wait_s
        self.trainer = Trainer(
            config, self.plan, ready_timeout_s=ready, startup=clock, owns_ray=self.owns_ray
        )
        sig.reinstall()
        run_dir = self.result.run_dir
        if config.checkpoint.async_save:
            self.saver = AsyncCheckpoints(self.trainer, config=config, run_dir=run_dir, hold=sig.held)
        self.stage = f"resuming from {self.resume}" if self.resume else "starting the step loop"
        start = _resume(
            self.trainer, self.resume, self.checked, loader=loader, schedule=schedule, console=self.console,
            resume_horizon=t.resume_horizon,
        )  # fmt: skip
        clock.mark("resume")
        evals = EvalLoop(
            batches=self.data.evals,
            train=t,
            total=self.data.length.steps,
            run_dir=run_dir,
            console=self.console,
        )
        self.loop = _Loop(
            config=config, plan=self.plan, trainer=self.trainer, loader=loader, schedule=schedule,
            run_dir=run_dir, result=self.result, sig=sig, resumed_from=self.resume, saver=self.saver, evals=evals,
        )  # fmt: skip
        return start

    def _steps(self, clock: Startup, *, start: int) -> None:
        """The step loop under the progress display; then its summary and the start-up table."""
        from dhp.runtime.loop.progress import TrainProgress

        result, loop, sig = self.result, self.loop, self.sig
        sig.mode = "defer"
        with TrainProgress(console=self.console, total=self.data.length.steps, start=start) as progress:
            loop.run(start=start, progress=progress)
        sig.mode = "quiet"  # the run is over: a signal now is counted, nothing is cut
        progress.summary(result, loop.records)
        if loop.records and clock is result.startup:
            clock.add("step 1 (its own wall time)", loop.records[0]["step_s"])
            clock.render(self.console)
            clock.write(result.run_dir / "startup.json")
        if result.interrupted:
            loop.say_stopped(self.console)

    def _stopped(self, line: str) -> None:
        """A signal stopped the attempt at once: no graceful teardown, the run is interrupted."""
        self.graceful, self.result.interrupted = False, True
        self.console.print(line)

    def _exited(self, e: SystemExit) -> None:
        """SIGTERM inside ray.init: Ray's own handler (set there, before ours is put back) exits 15;
        any other SystemExit goes on up."""
        if e.code != signal.SIGTERM or self.trainer is not None:
            raise e
        self.result.signal = self.result.signal or signal.SIGTERM
        self._stopped("terminated while starting Ray; nothing was trained or saved")
        import ray

        with contextlib.suppress(Exception):
            ray.shutdown()  # whatever that half-done ray.init started

    def _failed(self, e: RuntimeFailure) -> None:
        """A failed attempt, before its teardown: read every rank's stack when the ranks may still be
        running (a hang, a broken collective), write the tracebacks, then raise _Restart when the
        supervisor restarts, else the RuntimeFailure that ends the run (naming any stuck rank)."""
        result, trainer, failures = self.result, self.trainer, self.boss.failures
        step = self.loop.failing_step() if self.loop is not None else 0
        stacks = trainer.rank_stacks() if trainer is not None and failure_kind(e) == INFRA else []
        stuck = "".join(f"\n  stuck: {line}" for line in stuck_lines(stacks))
        signum = result.signal if self.sig.requested else None
        decision = self.boss.on_failure(e, step=step, started=trainer is not None, signum=signum)
        path = failures.write(e, attempt=decision.attempt, step=step, verdict=decision.verdict, stacks=stacks)
        if decision.action == RESTART:
            if stuck:
                self.console.print(escape(f"{str(e).splitlines()[0]}{stuck}"))
            result.restarts = self.boss.restarts
            raise _Restart(e, decision) from e
        append_event(
            result.run_dir / "metrics.jsonl", failed_event(e, step=step, why=decision.why, path=path)
        )
        last = result.last_checkpoint
        hint = (
            f"last good checkpoint: {last} (resume with train.resume=auto)"
            if last
            else "no checkpoint was written yet"
        )
        raise RunFailed(f"{e}{stuck}\n  not restarted: {decision.why}\n  tracebacks: {path}\n  {hint}") from e

    def _teardown(self) -> None:
        """The teardown runs to its end (a third signal still exits at once): the groups or Ray,
        the save in flight, the temp dirs of a cut save."""
        self.sig.mode = "quiet"
        if self.trainer is not None:
            self.trainer.close(graceful=self.graceful)
        elif self.owns_ray:  # Ray started but no trainer took it over (an interrupt, or Trainer failed)
            import ray  # loaded already: Ray started above

            with contextlib.suppress(Exception):
                ray.shutdown()
        if self.saver is not None:  # a save still in flight never counts: its writers are gone
            self.saver.abandon()
        # a save cut by a second signal: its ranks may have written into the temp dir after the driver
        # removed it; they are gone now, so nothing can recreate it
        from dhp.checkpoint import (
            remove_own_temps,  # after the start-up's imports (dhp.runtime.launch.startup)
        )

        remove_own_temps(self.result.run_dir / "checkpoints")


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


def _resume(trainer, resume, checked, *, loader, schedule, console, resume_horizon: str = "keep") -> int:
    """Load ``resume`` (if any, checked by ``_check_resume``) into the groups, the loader, the LR
    schedule (its horizon per ``train.resume_horizon``: ``dhp.runtime.loop.horizon``) and the driver RNG."""
    if resume is None:
        return 0
    from dhp.checkpoint import restore_rng_state

    meta, notes = checked
    trainer.load_modules(str(resume))
    loader.load_state_dict(meta.data_state)
    if meta.scheduler_state is not None:
        state = meta.scheduler_state
        apply(schedule, state, horizon_change(state, schedule, mode=resume_horizon))
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


def _save(trainer, *, config, plan, step, loader, schedule, run_dir, hold=contextlib.nullcontext) -> Path:
    """Write ``checkpoints/step_XXXXXX`` atomically: groups save into a temp dir, then meta + rename
    inside ``hold()`` (a second signal does not cut the commit). Interrupted or failed before the
    commit, the temp dir is removed and the previous checkpoint stays the newest."""
    from dhp.checkpoint import begin_checkpoint, commit_checkpoint

    # loads the worker's module (torch.distributed, transformers): after Ray's start (dhp.runtime.launch.startup)
    from dhp.runtime.loop.checkpointing import is_io_failure, save_failed

    try:
        tmp = begin_checkpoint(run_dir / "checkpoints", step=step)
    except OSError as e:
        raise save_failed(run_dir, step, e) from e
    try:
        trainer.save_modules(str(tmp))
        meta = _meta(config=config, plan=plan, step=step, loader=loader, schedule=schedule)
        with hold():
            return commit_checkpoint(tmp, meta=meta, keep_last=config.train.keep_last)
    except BaseException as e:  # a failed or interrupted save leaves no temp dir behind
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) or (isinstance(e, RuntimeFailure) and is_io_failure(str(e))):
            raise save_failed(run_dir, step, e) from e
        raise


class _Loop:
    """The step loop: data -> lr -> driver step -> metrics -> evaluation when due -> checkpoint; a
    signal (``sig``) ends it at the next step boundary, with a checkpoint of that step."""

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
        sig: Signals,
        resumed_from=None,
        saver=None,
        evals: EvalLoop,
    ) -> None:
        from dhp.metrics import MetricsWriter
        from dhp.metrics.loggers import open_loggers

        self.config, self.plan, self.trainer = config, plan, trainer
        self.loader, self.schedule, self.run_dir, self.result = loader, schedule, run_dir, result
        self.sig = sig
        self.saver = saver  # AsyncCheckpoints when checkpoint.async_save, else None (synchronous saves)
        self.evals = evals
        self.total = evals.total  # the run's last step (train.steps, or what train.epochs make)
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
        self._running: int | None = None
        self._stop_saved: Path | None = None  # the checkpoint the stop wrote or found (None: none)
        self.devices = len({r.global_gpu for g in plan.groups for r in g.ranks})

    def run(self, *, start: int, progress) -> None:
        """Steps ``start + 1 ..`` the run's last; after a signal, the step running ends the loop."""
        from dhp.metrics.record import build_record

        t = self.config.train
        try:
            self.done_step = start
            for step in range(start + 1, self.total + 1):
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
                if step % t.log_every == 0 or step == self.total:
                    self.writer.write(rec)
                progress.update(step=step, record=rec)
                evaluated = self._evaluate(step)
                if self.saver is not None:
                    self._checkpoint_async(step)
                elif _checkpoint_due(t, step, total=self.total):
                    self.result.last_checkpoint = self._save(step)
                if evaluated is not None and t.keep_best and self.evals.is_best(evaluated):
                    self.evals.keep(self._checkpoint_of(step), evaluated)
                if self.sig.requested and step < self.total:
                    self._stop(step)
                    return
        finally:
            self.writer.close()

    def _evaluate(self, step: int):
        """The evaluation after ``step`` when one is due (``dhp.runtime.loop.eval_loop``), else None."""
        if not self.evals.due(step, stopping=self.sig.requested):
            return None
        res = self.evals.run(self.trainer, step, writer=self.writer, stop=lambda: self.sig.requested)
        if res is not None:
            self.result.evals[step] = res.loss
        return res

    def _checkpoint_of(self, step: int) -> Path:
        """This step's committed checkpoint: the one just written, else one written now."""
        if self.saver is not None:
            done = self.saver.finish()  # the save in flight (this step's, when it was due)
            self.result.last_checkpoint = done or self.result.last_checkpoint
            last = self.result.last_checkpoint
            if last is not None and last.name == f"step_{step:06d}" and last.parent.parent == self.run_dir:
                return last
            meta = _meta(
                config=self.config, plan=self.plan, step=step, loader=self.loader, schedule=self.schedule
            )
            self.saver.start(step=step, meta=meta)
            self.result.last_checkpoint = self.saver.finish()
            return self.result.last_checkpoint
        last = self.result.last_checkpoint
        if last is None or last.name != f"step_{step:06d}" or last.parent.parent != self.run_dir:
            self.result.last_checkpoint = self._save(step)
        return self.result.last_checkpoint

    def _save(self, step: int) -> Path:
        return _save(
            self.trainer,
            config=self.config,
            plan=self.plan,
            step=step,
            loader=self.loader,
            schedule=self.schedule,
            run_dir=self.run_dir,
            hold=self.sig.held,
        )

    def _stop(self, step: int) -> None:
        """A signal came during ``step`` (now done on every rank): commit the save in flight, write
        this step's checkpoint unless one is there (or ``train.save_on_interrupt`` is false)."""
        self.result.interrupted = True
        if self.saver is not None:
            self.result.last_checkpoint = self.saver.finish() or self.result.last_checkpoint
        last = self.result.last_checkpoint
        if last is not None and last.parent.parent == self.run_dir and last.name == f"step_{step:06d}":
            self._stop_saved = last
        elif self.config.train.save_on_interrupt:
            self._stop_saved = self.result.last_checkpoint = self._save(step)

    def say_stopped(self, console: Console) -> None:
        """The line that ends an interrupted run: what was saved."""
        step, saved = self.done_step, self._stop_saved
        after = f" ({time.monotonic() - self.result.signal_time:.1f} s after {signal.Signals(self.result.signal).name})"
        if saved is not None:
            console.print(f"interrupted after step {step}{after}: saved {saved}")
        else:
            last = self.result.last_checkpoint or "none"
            console.print(
                f"interrupted after step {step}{after}: nothing saved (train.save_on_interrupt=false); last good checkpoint: {last}"
            )

    def _checkpoint_async(self, step: int) -> None:
        """Commit the save in flight once written; start this step's save when due (the last step's
        is waited for: the run ends with its final checkpoint committed)."""
        t = self.config.train
        done = self.saver.poll()
        if _checkpoint_due(t, step, total=self.total):
            meta = _meta(
                config=self.config, plan=self.plan, step=step, loader=self.loader, schedule=self.schedule
            )
            done = self.saver.start(step=step, meta=meta) or done
            if step == self.total:
                done = self.saver.finish()
        if done is not None:
            self.result.last_checkpoint = done

    def failing_step(self) -> int:
        """The step a failure interrupted: the one running, else the one after the last done."""
        if self._running is not None:
            return self._running
        return (self.done_step or 0) + 1


def _checkpoint_due(train: TrainConfig, step: int, *, total: int | None = None) -> bool:
    """A checkpoint is written after ``step``: every ``train.checkpoint_every`` steps (0: never on a
    stride) and always after the last step (``total``: the run's length, default ``train.steps``).
    The one rule for the synchronous and async savers."""
    last = train.steps if total is None else total
    return bool(train.checkpoint_every and step % train.checkpoint_every == 0) or step == last
