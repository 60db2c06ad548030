"""Failure classification before a restart, and the traceback file of a failed attempt.

A failed attempt is one of two kinds:

- **infrastructure**: an actor or node lost (killed, OOM-killed, preempted), a collective that broke
  or timed out, a step or call that hung. A fresh set of actors resumed from the newest verified
  checkpoint may pass, so ``dhp train`` restarts (up to ``train.max_restarts``).
- **code**: a Python exception raised by dhp's or the model's own code on a rank (a
  ``NotImplementedError``, a shape error, a ``DataError``). It recurs on every attempt, so the run
  ends at once, naming the error and the rank.

An infrastructure failure that repeats the previous attempt's failure at the same step (same module,
rank and error) also ends the run: it is as deterministic as a code error.

Every failure appends the full tracebacks to ``<run_dir>/traceback.txt``: each rank whose call
failed (the remote traceback names the raising line), then the driver's. Nothing here touches
placements or memory; it runs on the driver, after the failed attempt's actors are gone.
"""

from __future__ import annotations

import os
import re
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from dhp.errors import DhpError, RuntimeFailure

INFRA = "infrastructure"
CODE = "code"
TRACEBACK_FILE = "traceback.txt"

#: a test-only fault hook: ``<module>:<rank or *>`` makes that module's optimizer step raise
#: NotImplementedError on that rank (the deterministic error of the no-restart drill)
FAULT_ENV = "DHP_INJECT_FAULT"


def _ray_infra() -> tuple[type, ...]:
    """Ray's errors for a lost actor, node, worker or object, an OOM kill, and a timeout (ray is
    imported here, not at module import: ``dhp plan`` never needs it)."""

    e = ray.exceptions
    return (
        e.RayActorError,  # ActorDiedError, ActorUnavailableError
        e.NodeDiedError,
        e.OutOfMemoryError,
        e.WorkerCrashedError,
        e.ObjectLostError,
        e.OwnerDiedError,
        e.LocalRayletDiedError,
        e.RaySystemError,
        e.GetTimeoutError,
        e.ObjectFetchTimedOutError,
    )


#: what torch.distributed's backends say when a peer is gone or a collective timed out
_COLLECTIVE = re.compile(
    r"gloo|nccl|connection (closed|reset|refused)|broken pipe|timed out|timeout|socket|"
    r"process ?group|c10d|peer",
    re.IGNORECASE,
)
_PID = re.compile(r"\s*\(pid \d+\)")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


@dataclass(frozen=True)
class RankError:
    """One rank's failed call: who, which kind, the one-line summary and the full traceback text."""

    module: str
    rank: int
    kind: str
    summary: str
    traceback: str
    lost: bool = False  # the rank's actor or node is gone (its peers' errors follow from that)


def classify(err: BaseException) -> str:
    """INFRA or CODE for one rank's error as the driver received it from Ray."""

    infra = _ray_infra()
    if isinstance(err, infra):
        return INFRA
    cause = err.cause if isinstance(err, ray.exceptions.RayTaskError) else err
    if cause is None or isinstance(cause, infra):
        return INFRA
    if cause is not err and isinstance(cause, ray.exceptions.RayError):  # a call the rank made failed
        return classify(cause)
    if isinstance(cause, RuntimeFailure):  # dhp's own runtime checks inside a worker (a stale bridge)
        return INFRA
    if isinstance(cause, DhpError):  # a DataError, ConfigError, ... recurs
        return CODE

    if isinstance(
        cause, torch.distributed.DistError | torch.OutOfMemoryError | ConnectionError | TimeoutError
    ):
        return INFRA
    if isinstance(cause, RuntimeError) and _COLLECTIVE.search(str(cause).split("\n", 1)[0]):
        return INFRA
    return CODE


def rank_error(module: str, rank: int, summary: str, err: BaseException) -> RankError:
    """The RankError of ``err`` (a RayTaskError carries the rank's own traceback)."""

    if isinstance(err, ray.exceptions.RayTaskError):  # its text is the rank's traceback
        text = _ANSI.sub("", str(err))
    else:
        text = "".join(traceback.format_exception_only(type(err), err))
    lost = isinstance(err, ray.exceptions.ActorDiedError | ray.exceptions.ActorUnavailableError)
    return RankError(module=module, rank=rank, kind=classify(err), summary=summary, traceback=text, lost=lost)


class WorkerFailure(RuntimeFailure):
    """A call that failed on one or more ranks; ``errors`` holds each one, the blamed rank first."""

    def __init__(self, message: str, *, errors: list[RankError]) -> None:
        super().__init__(message)
        self.errors = errors

    @property
    def kind(self) -> str:
        """INFRA when the blamed rank was lost; else CODE if any rank raised a code error."""
        if self.errors and self.errors[0].lost:
            return INFRA
        return CODE if any(e.kind == CODE for e in self.errors) else INFRA


def failure_kind(err: RuntimeFailure) -> str:
    """CODE when a rank raised a Python exception of dhp's or the model's; INFRA otherwise (a lost
    actor, a hang: the RuntimeFailures the driver raises itself)."""
    return err.kind if isinstance(err, WorkerFailure) else INFRA


def _signature(err: RuntimeFailure) -> str:
    """What makes two failures "the same error": the message's first line without pids."""
    return _PID.sub("", str(err).split("\n", 1)[0])


class FailureLog:
    """The failures of one run (across its attempts): decides whether the next attempt may start,
    and writes each failure's tracebacks to ``<run_dir>/traceback.txt``."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / TRACEBACK_FILE
        self._last: tuple[str, int] | None = None

    def verdict(self, err: RuntimeFailure, *, step: int) -> str | None:
        """None if a restart may heal ``err`` (failed while running ``step``), else why not."""
        same = self._last == (_signature(err), step)
        self._last = (_signature(err), step)
        if failure_kind(err) == CODE:
            return "a Python exception raised by dhp's or the model's code recurs on every attempt"
        if same:
            return f"the same error at the same step ({step}) twice"
        return None

    def write(self, err: BaseException, *, attempt: int, step: int, verdict: str) -> Path:
        """Append every failed rank's traceback and the driver's for this failure; returns the path."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        lines = [
            f"==== attempt {attempt}, while running step {step}, {stamp} (driver pid {os.getpid()})",
            f"error: {str(err).splitlines()[0] if str(err) else type(err).__name__}",
            f"outcome: {verdict}",
            "",
        ]
        for e in err.errors if isinstance(err, WorkerFailure) else []:
            lines += [
                f"---- module '{e.module}' rank {e.rank} ({e.kind}): {e.summary}",
                e.traceback.rstrip(),
                "",
            ]
        lines += ["---- driver", "".join(traceback.format_exception(err)).rstrip(), "", ""]
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines))
        return self.path


def failed_event(err: BaseException, *, step: int, why: str, path: Path) -> dict:
    """The ``{"event": "failed", ...}`` line a run that ends on a failure appends to metrics.jsonl."""
    return {
        "event": "failed",
        "step": step,
        "time": time.time(),
        "reason": str(err).split("\n", 1)[0],
        "why_not_restarted": why,
        "traceback": path.name,
    }


def maybe_inject_fault(module: str, rank: int) -> None:
    """Raise NotImplementedError when ``$DHP_INJECT_FAULT`` is ``<module>:<rank>`` (or ``<module>:*``)
    of this worker (a test-only hook, called at each optimizer step: the deterministic worker error
    of the no-restart drill; unset, it costs one environment lookup)."""
    spec = os.environ.get(FAULT_ENV)
    if spec and spec.split(":")[0] == module and spec.split(":")[-1] in ("*", str(rank)):
        raise NotImplementedError(f"fault injected by {FAULT_ENV}={spec}")
