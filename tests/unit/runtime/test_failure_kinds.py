"""Which failures restart a run: Ray's own error objects (as ``ray.get`` raises them on the driver)
classified, and the "same error at the same step twice" rule (no Ray started: the error objects
are built the way Ray builds them from a rank's exception)."""

from __future__ import annotations

import pytest
import ray
import torch

from dhp.errors import DataError, RuntimeFailure
from dhp.runtime.actors.failures import CODE, INFRA, FailureLog, WorkerFailure, classify, rank_error

pytestmark = pytest.mark.unit


def _raised_on_a_rank(cause: BaseException) -> BaseException:
    """What ``ray.get`` raises on the driver when an actor method raised ``cause``."""
    tb = (
        f'Traceback (most recent call last):\n  File "w.py", line 3, in step\n{type(cause).__name__}: {cause}'
    )
    err = ray.exceptions.RayTaskError("optimizer_step", tb, cause, proctitle="w", pid=7, ip="10.0.0.1")
    return err.as_instanceof_cause()


@pytest.mark.parametrize(
    ("err", "kind"),
    [
        (_raised_on_a_rank(NotImplementedError("no kernel")), CODE),
        (_raised_on_a_rank(ValueError("shape mismatch")), CODE),
        (_raised_on_a_rank(DataError("bad.jsonl line 3: no image")), CODE),
        (ray.exceptions.ActorDiedError(), INFRA),  # killed, OOM-killed, node preempted
        (ray.exceptions.OutOfMemoryError("the memory monitor killed the worker"), INFRA),
        (ray.exceptions.NodeDiedError("node gone"), INFRA),
        (_raised_on_a_rank(torch.distributed.DistBackendError("NCCL watchdog timeout")), INFRA),
        (_raised_on_a_rank(RuntimeError("[gloo] Connection closed by peer [10.0.0.2]:1234")), INFRA),
        (_raised_on_a_rank(RuntimeError("Timed out waiting 1800000ms for recv operation")), INFRA),
        (_raised_on_a_rank(ray.exceptions.ActorDiedError()), INFRA),  # a ref from a dead peer
        (_raised_on_a_rank(RuntimeFailure("the p2p bridge has transfers from an aborted step")), INFRA),
    ],
)
def test_classify(err: BaseException, kind: str) -> None:
    assert classify(err) == kind


def test_a_lost_rank_is_infrastructure_even_when_a_peer_raised() -> None:
    lost = rank_error("llm", 1, "died", ray.exceptions.ActorDiedError())
    peer = rank_error("llm", 0, "failed", _raised_on_a_rank(ValueError("x")))
    assert WorkerFailure("llm rank 1 died", errors=[lost, peer]).kind == INFRA
    assert WorkerFailure("llm rank 0 failed", errors=[peer, lost]).kind == CODE


def test_same_infrastructure_error_at_the_same_step_twice_ends_the_run(tmp_path) -> None:
    log = FailureLog(tmp_path)
    hang = RuntimeFailure("group 'llm': 'consume' did not finish in 900s on rank(s) [1] (a hang)")
    died = WorkerFailure("module 'llm' rank 1 (pid 11) died: gone", errors=[])
    assert log.verdict(hang, step=4) is None
    assert log.verdict(hang, step=5) is None  # another step: may heal
    assert log.verdict(died, step=5) is None  # another error
    again = WorkerFailure("module 'llm' rank 1 (pid 42) died: gone", errors=[])  # a new actor's pid
    assert log.verdict(again, step=5) == "the same error at the same step (5) twice"


def test_code_error_ends_the_run_and_its_tracebacks_are_written(tmp_path) -> None:
    err = _raised_on_a_rank(NotImplementedError("no kernel"))
    failure = WorkerFailure("module 'llm' rank 0 failed", errors=[rank_error("llm", 0, "failed", err)])
    log = FailureLog(tmp_path)
    why = log.verdict(failure, step=1)
    assert why is not None and "Python exception" in why
    text = log.write(failure, attempt=1, step=1, verdict=f"run ended: {why}").read_text()
    assert "---- module 'llm' rank 0 (code): failed" in text
    assert 'File "w.py", line 3, in step\nNotImplementedError: no kernel' in text
    assert "---- driver" in text and "run ended: a Python exception" in text
