"""The run's supervisor, one test per branch of its policy: restart after the backoff, give up
(no restart left, the same error twice, a code error on a rank), stop on Ctrl-C and on SIGTERM
(exit 128 + signal), stop at once on a deterministic error. The real Supervisor and FailureLog,
driven with the exception types the runtime raises (Ray's error objects built as Ray builds them
from a rank's exception); no Ray started."""

from __future__ import annotations

import signal

import pytest
import ray

from dhp.config.schema import TrainConfig
from dhp.errors import ConfigError, DataError, PlanError, RuntimeFailure
from dhp.runtime.actors.failures import FailureLog, RunFailed, WorkerFailure, rank_error
from dhp.runtime.loop.checkpointing import SaveFailed
from dhp.runtime.loop.driver_step import NonFiniteStep
from dhp.runtime.loop.supervisor import GIVE_UP, RESTART, STOP, Supervisor, exit_code

pytestmark = pytest.mark.unit


def _boss(tmp_path, *, max_restarts: int = 2, backoff: float = 1.5) -> Supervisor:
    return Supervisor(TrainConfig(max_restarts=max_restarts, restart_backoff_s=backoff), FailureLog(tmp_path))


def _lost_rank(step_text: str = "step") -> WorkerFailure:
    """A rank's actor died during a call: an infrastructure failure a fresh attempt may pass."""
    err = rank_error("llm", 1, step_text, ray.exceptions.ActorDiedError())
    return WorkerFailure(f"module 'llm' rank 1 died during {step_text}", errors=[err])


def _code_error_on_a_rank() -> WorkerFailure:
    """A rank raised a Python exception of dhp's or the model's code (as ray.get delivers it)."""
    tb = 'Traceback (most recent call last):\n  File "w.py", line 3, in step\nNotImplementedError: no kernel'
    cause = NotImplementedError("no kernel")
    raised = ray.exceptions.RayTaskError("step", tb, cause, proctitle="w", pid=7, ip="10.0.0.1")
    err = rank_error("vision", 0, "forward", raised.as_instanceof_cause())
    return WorkerFailure("module 'vision' rank 0 failed in forward: NotImplementedError", errors=[err])


def test_restart_after_the_backoff_until_none_is_left(tmp_path):
    boss = _boss(tmp_path, max_restarts=2, backoff=1.5)
    first = boss.on_failure(_lost_rank(), step=3, started=True)
    assert (first.action, first.restart, first.attempt, first.wait_s) == (RESTART, 1, 1, 1.5)
    assert first.verdict == "restarted (1 of 2)"
    second = boss.on_failure(RuntimeFailure("step 4 timed out after 30 s"), step=4, started=True)
    assert (second.action, second.restart, second.attempt) == (RESTART, 2, 2)
    assert second.verdict == "restarted (2 of 2)"
    assert boss.restarts == 2
    # a restart going ahead when no signal came in the teardown
    assert boss.before_restart(second, signum=None) is second


def test_give_up_when_no_restart_is_left(tmp_path):
    boss = _boss(tmp_path, max_restarts=1)
    assert boss.on_failure(_lost_rank(), step=2, started=True).action == RESTART
    last = boss.on_failure(RuntimeFailure("step 5 timed out"), step=5, started=True)
    assert (last.action, last.attempt) == (GIVE_UP, 2)
    assert last.why == "no restart left (after 1 restart(s), train.max_restarts=1)"
    assert last.verdict == f"run ended: {last.why}"
    assert boss.restarts == 1


def test_give_up_on_the_same_error_at_the_same_step_twice(tmp_path):
    boss = _boss(tmp_path, max_restarts=5)
    assert boss.on_failure(_lost_rank(), step=7, started=True).action == RESTART
    again = boss.on_failure(_lost_rank(), step=7, started=True)
    assert (again.action, again.why) == (GIVE_UP, "the same error at the same step (7) twice")


def test_give_up_when_the_groups_never_started(tmp_path):
    d = _boss(tmp_path).on_failure(RuntimeFailure("placement group not ready"), step=0, started=False)
    assert (d.action, d.why) == (GIVE_UP, "the actor groups did not start")


@pytest.mark.parametrize(
    ("err", "why"),
    [
        (
            _code_error_on_a_rank(),
            "a Python exception raised by dhp's or the model's code recurs on every attempt",
        ),
        (NonFiniteStep("step 3: loss is nan"), "restarting would not change it"),
        (
            SaveFailed("saving the step 4 checkpoint failed: No space left on device"),
            "restarting would not change it",
        ),
    ],
)
def test_deterministic_failures_of_an_attempt_give_up_at_once(tmp_path, err, why):
    boss = _boss(tmp_path, max_restarts=3)
    d = boss.on_failure(err, step=3, started=True)
    assert (d.action, d.why, d.attempt, boss.restarts) == (GIVE_UP, why, 1, 0)


@pytest.mark.parametrize(
    ("err", "why"),
    [
        (
            DataError("train.jsonl line 3: image missing"),
            "a DataError recurs on every attempt (fix it and resume)",
        ),
        (ConfigError("train.lr: -1 is not > 0"), "a ConfigError recurs on every attempt (fix it and resume)"),
        (
            PlanError("llm tp=3 does not divide 4 kv heads"),
            "a PlanError recurs on every attempt (fix it and resume)",
        ),
        (KeyError("pixel_values"), "an error in dhp"),
    ],
)
def test_a_deterministic_error_stops_the_run_at_once_and_is_recorded(tmp_path, err, why):
    boss = _boss(tmp_path)
    d = boss.on_error(err)
    assert (d.action, d.why, d.record, boss.restarts) == (GIVE_UP, why, True, 0)


def test_a_failure_already_recorded_is_not_recorded_twice(tmp_path):
    d = _boss(tmp_path).on_error(RunFailed("module 'llm' rank 1 died\n  not restarted: ..."))
    assert (d.action, d.record) == (GIVE_UP, False)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_run_with_128_plus_the_signal(tmp_path, signum, code):
    boss = _boss(tmp_path)
    assert (boss.on_signal(signum).action, boss.on_signal(signum).exit_code) == (STOP, code)
    assert exit_code(signum) == code
    # a restart decided, then the signal came during the failed attempt's teardown: no new attempt
    restart = boss.on_failure(_lost_rank(), step=2, started=True)
    stop = boss.before_restart(restart, signum=signum)
    assert (stop.action, stop.exit_code) == (STOP, code)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_failure_while_a_stop_was_asked_for_is_not_restarted(tmp_path, signum):
    d = _boss(tmp_path).on_failure(_lost_rank(), step=4, started=True, signum=signum)
    assert (d.action, d.why) == (GIVE_UP, f"a stop was asked for ({signal.Signals(signum).name})")


def test_an_interrupted_run_without_a_signal_number_exits_as_ctrl_c():
    assert exit_code(None) == 130
