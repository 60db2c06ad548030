"""The test-only fault hook (``DHP_INJECT_FAULT``, dhp.runtime.actors.failures): its grammar, that each fault
fires once, in the step it names (a save point: the step it saves), and where it is refused."""

from __future__ import annotations

import signal
import time

import pytest

from dhp.runtime.actors.failures import DELAY_S, FAULT_ENV, Fault, FaultHook, parse_faults

pytestmark = pytest.mark.unit


def test_the_grammar_reads_every_action_and_place() -> None:
    got = parse_faults(
        "raise:llm/0:optimizer, hang:vision/*:grad_sync:2,sigterm:driver:produce:3,delay:llm/1:forward"
    )
    assert got == [
        Fault("raise", "llm", 0, "optimizer", None),
        Fault("hang", "vision", None, "grad_sync", 2),
        Fault("sigterm", "driver", None, "produce", 3),
        Fault("delay", "llm", 1, "forward", None),
    ]
    assert parse_faults("") == []


@pytest.mark.parametrize(
    "bad", ["llm:0", "explode:llm/0:optimizer", "raise:llm/0:nowhere", "raise:llm:optimizer", "raise:a:b:c:d"]
)
def test_a_malformed_fault_is_refused(bad) -> None:
    with pytest.raises(ValueError, match=FAULT_ENV):
        parse_faults(bad)


def test_a_fault_fires_once_in_its_step_on_its_rank(monkeypatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "raise:llm/1:produce:2,raise:llm/*:save:2")
    other = FaultHook("llm", 0)
    hook = FaultHook("llm", 1)
    hook.at("produce")  # step 1: not yet
    hook.step_done()
    with pytest.raises(NotImplementedError, match="produce, step 2"):
        hook.at("produce")
    hook.at("produce")  # once per process: the second micro-batch of step 2 passes
    hook.at("save")  # the boundary after step 1: not the step it names
    hook.step_done()
    with pytest.raises(NotImplementedError, match="save, step 2"):
        hook.at("save")  # the save after step 2
    other.at("produce")
    other.step_done()
    other.at("produce")  # rank 0 has only the save fault
    assert FaultHook("vision", 1).faults == []


def test_the_driver_signals_itself(monkeypatch) -> None:
    got = []
    monkeypatch.setenv(FAULT_ENV, "sigterm:driver:consume")
    old = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    try:
        hook = FaultHook("driver")
        hook.at("produce")
        hook.at("consume")
        hook.at("consume")
    finally:
        signal.signal(signal.SIGTERM, old)
    assert got == [signal.SIGTERM]


def test_a_delay_holds_its_phase_once(monkeypatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "delay:llm/0:forward")
    hook = FaultHook("llm", 0)
    t0 = time.perf_counter()
    hook.at("forward")
    held = time.perf_counter() - t0
    t1 = time.perf_counter()
    hook.at("forward")  # once per process
    assert held >= DELAY_S and time.perf_counter() - t1 < DELAY_S
