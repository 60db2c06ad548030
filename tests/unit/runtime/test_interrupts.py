"""What each SIGINT/SIGTERM does in each part of a run (dhp.runtime.loop.interrupts.Signals): before the
loop the first one raises; in the loop it only asks for a stop and the second one raises HardStop,
after a commit when it lands inside one; in the teardown nothing raises; a third one exits."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from dhp.runtime.loop.interrupts import HardStop, Signals, run_signals

pytestmark = pytest.mark.unit


def _sig() -> Signals:
    return Signals(SimpleNamespace(signal=None, signal_time=None))


def test_before_the_loop_the_first_signal_raises_and_a_second_adds_nothing() -> None:
    s = _sig()
    with pytest.raises(KeyboardInterrupt):
        s.handler(signal.SIGTERM, None)
    s.handler(signal.SIGINT, None)  # the stop is under way
    assert s.requested and s.result.signal == signal.SIGTERM and s.result.signal_time is not None


def test_in_the_loop_the_first_signal_asks_and_the_second_stops_at_once(capfd) -> None:
    s = _sig()
    s.mode = "defer"
    s.handler(signal.SIGINT, None)  # never raises inside a step
    assert s.requested and "SIGINT: finishing the running step" in capfd.readouterr().err
    with pytest.raises(HardStop):
        s.handler(signal.SIGINT, None)


def test_a_second_signal_inside_a_commit_stops_after_it() -> None:
    s = _sig()
    s.mode = "defer"
    s.handler(signal.SIGTERM, None)
    done = []
    with pytest.raises(HardStop), s.held():
        s.handler(signal.SIGTERM, None)  # not here: the commit goes on
        done.append("renamed")
    assert done == ["renamed"]


def test_the_teardown_is_not_cut_and_a_third_signal_exits(monkeypatch) -> None:
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    s = _sig()
    s.mode = "quiet"
    s.handler(signal.SIGTERM, None)
    s.handler(signal.SIGTERM, None)
    assert exits == []
    s.handler(signal.SIGTERM, None)
    assert exits == [128 + signal.SIGTERM]


def test_a_real_signal_reaches_the_handler_and_the_old_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    result = SimpleNamespace(signal=None, signal_time=None)
    with run_signals(result) as s:
        s.mode = "defer"
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs at a bytecode boundary of the main thread
            if s.requested:
                break
    assert result.signal == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def _ctrl_c_in_a_run(previous) -> SimpleNamespace:
    """A real SIGINT inside ``run_signals`` (the step loop's mode) under SIGINT handler ``previous``."""
    result = SimpleNamespace(signal=None, signal_time=None)
    old = signal.signal(signal.SIGINT, previous)
    try:
        with run_signals(result) as s:
            s.mode = "defer"
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                if s.requested:
                    break
            assert s.requested  # the graceful stop: nothing raised inside the run
    finally:
        signal.signal(signal.SIGINT, old)
    return result


def test_ctrl_c_reaches_a_caller_with_python_default_handling_after_the_stop() -> None:
    """pytest, a notebook, a script: the run stops gracefully, then the caller's KeyboardInterrupt
    (carrying the run's result), so `make test` stops on Ctrl-C as on any other test."""
    from dhp.runtime.loop.interrupts import RunInterrupted

    with pytest.raises(KeyboardInterrupt) as stop:
        _ctrl_c_in_a_run(signal.default_int_handler)
    assert isinstance(stop.value, RunInterrupted) and stop.value.result.signal == signal.SIGINT
    own = _ctrl_c_in_a_run(lambda signum, frame: None)  # a program with its own handler: the result
    assert own.signal == signal.SIGINT
