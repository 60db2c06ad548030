"""The run's supervisor: what ``dhp train`` does after an attempt ends in a failure or a signal.

One object holds the whole policy, so each rule lives in one place:

- **restart**: an infrastructure failure (a lost actor or node, a broken or hung collective, a step
  timeout) with restarts left (``train.max_restarts``): the next attempt starts after
  ``train.restart_backoff_s`` from the newest checkpoint of the run dir that verifies.
- **give up**: a failure no restart can heal, with the reason the run dir records
  (``why_not_restarted``): a Python exception raised by dhp's or the model's code on a rank, the
  same error at the same step twice, a non-finite step or a failed save, actor groups that never
  started, a stop asked for while the attempt failed, or no restart left.
- **stop on a signal**: Ctrl-C or SIGTERM: the step running ends, a checkpoint at that boundary
  (``dhp.runtime.loop.interrupts``), and the run exits ``128 + signal`` (130, 143); no new attempt.
- **stop at once on a deterministic error**: anything that is not a RuntimeFailure (a DataError, a
  ConfigError, a PlanError, a bad sample, a checkpoint error, a bug) recurs on every attempt: it is
  recorded in the run dir (unless already recorded: RunFailed) and raised.

The supervisor decides; ``dhp.runtime.loop.train`` carries the decision out (teardown, records, console
lines). Nothing here touches placements or memory.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from dhp.config.schema import TrainConfig
from dhp.errors import DhpError, RuntimeFailure
from dhp.runtime.actors.failures import FailureLog, RunFailed

RESTART = "restart"
GIVE_UP = "give up"
STOP = "stop"


@dataclass(frozen=True)
class Decision:
    """What happens after an attempt ended: ``action`` one of RESTART, GIVE_UP, STOP."""

    action: str
    attempt: int = 1  # the attempt that ended (1: the first)
    why: str | None = None  # GIVE_UP: why the run was not restarted (the ``failed`` event's reason)
    verdict: str = ""  # the ``outcome:`` line of the failure in traceback.txt
    wait_s: float = 0.0  # RESTART: the backoff before the next attempt starts
    restart: int = 0  # RESTART: its number (1: the first restart)
    exit_code: int | None = None  # STOP: the process's exit code, 128 + the signal
    record: bool = True  # GIVE_UP on a deterministic error: not yet recorded in the run dir


def exit_code(signum: int | None) -> int:
    """The exit code of a run a signal stopped: 128 + the signal (130 Ctrl-C, 143 SIGTERM); a run
    marked interrupted without a signal number counts as Ctrl-C."""
    return 128 + (signum or signal.SIGINT)


def _final(err: RuntimeFailure) -> bool:
    """A RuntimeFailure a fresh attempt would meet again: a non-finite step, a failed save (both
    imported here: they live beside torch and the worker, loaded once Ray started)."""
    # heavy: torch and the worker's module, loaded once Ray started (dhp.runtime.launch.startup)
    from dhp.runtime.loop.checkpointing import SaveFailed
    from dhp.runtime.loop.driver_step import NonFiniteStep

    return isinstance(err, NonFiniteStep | SaveFailed)


class Supervisor:
    """The restart / give-up / signal policy of one run, across its attempts (``restarts``: the
    restarts decided so far)."""

    def __init__(self, train: TrainConfig, failures: FailureLog) -> None:
        self.max_restarts = train.max_restarts
        self.backoff_s = train.restart_backoff_s
        self.failures = failures
        self.restarts = 0

    @property
    def attempt(self) -> int:
        """The number of the attempt running (1: the first)."""
        return self.restarts + 1

    def on_failure(
        self, err: RuntimeFailure, *, step: int, started: bool, signum: int | None = None
    ) -> Decision:
        """The decision after ``err`` ended an attempt while it ran ``step``: ``started`` when the
        actor groups were up, ``signum`` the signal asked for before or while it failed (if any)."""
        why = self.failures.verdict(err, step=step)  # code errors, the same error twice
        if why is None and _final(err):
            why = "restarting would not change it"
        if why is None and not started:
            why = "the actor groups did not start"
        if why is None and signum is not None:
            why = f"a stop was asked for ({signal.Signals(signum).name})"
        attempt = self.attempt
        if why is None and self.restarts < self.max_restarts:
            self.restarts += 1
            verdict = f"restarted ({attempt} of {self.max_restarts})"
            return Decision(
                RESTART, attempt=attempt, verdict=verdict, wait_s=self.backoff_s, restart=self.restarts
            )
        if why is None:
            why = (
                f"no restart left (after {self.restarts} restart(s), train.max_restarts={self.max_restarts})"
            )
        return Decision(GIVE_UP, attempt=attempt, why=why, verdict=f"run ended: {why}")

    def on_error(self, err: BaseException) -> Decision:
        """The decision after an exception that is not a RuntimeFailure: it recurs on every attempt,
        so the run stops at once. A user-fixable error (a DataError, ConfigError, PlanError,
        CheckpointError: a DhpError) says so; anything else is an error in dhp. ``record``: not yet
        written to the run dir (a RunFailed already was)."""
        why = (
            f"a {type(err).__name__} recurs on every attempt (fix it and resume)"
            if isinstance(err, DhpError)
            else "an error in dhp"
        )
        record = not isinstance(err, RunFailed)
        return Decision(GIVE_UP, attempt=self.attempt, why=why, verdict=f"run ended: {why}", record=record)

    def on_signal(self, signum: int | None) -> Decision:
        """The decision after Ctrl-C or SIGTERM: no new attempt; exit ``128 + signal``."""
        return Decision(STOP, attempt=self.attempt, exit_code=exit_code(signum))

    def before_restart(self, restart: Decision, *, signum: int | None) -> Decision:
        """A restart decided, once the failed attempt is torn down: a signal that came meanwhile
        (``signum``) stops the run instead (no new attempt); else the restart goes ahead."""
        return restart if signum is None else self.on_signal(signum)
