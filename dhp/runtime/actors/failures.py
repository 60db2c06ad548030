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
failed (the remote traceback names the raising line), every rank's Python stack when the ranks were
still running (a hang, a broken collective: ``dhp.runtime.actors.stacks``), then the driver's. Nothing here
touches placements or memory; it runs on the driver, before the failed attempt's actors are gone.

``DHP_INJECT_FAULT`` (:class:`FaultHook`, tests only) makes a chosen rank raise, hang in a
collective or signal the driver at a chosen point of a chosen step, or the driver signal itself
between two ranks' submissions of a call.
"""

from __future__ import annotations

import os
import re
import signal
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from dhp.errors import DhpError, RuntimeFailure

INFRA = "infrastructure"
CODE = "code"
TRACEBACK_FILE = "traceback.txt"

#: the test-only fault hook (:class:`FaultHook`): ``ACTION:WHERE:POINT[:STEP]``, comma-separated
FAULT_ENV = "DHP_INJECT_FAULT"
#: the driver's pid, put beside the hook into the ranks' environment (a rank's signal goes there)
FAULT_DRIVER_ENV = "DHP_INJECT_FAULT_DRIVER"


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


class RunFailed(RuntimeFailure):
    """The failure that ended a run, already recorded in its run dir (``traceback.txt`` and the
    ``failed`` event of ``metrics.jsonl``): nothing is written for it a second time."""


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

    def write(
        self, err: BaseException, *, attempt: int, step: int, verdict: str, stacks: Sequence[Any] = ()
    ) -> Path:
        """Append every failed rank's traceback, every rank's stack (``stacks``: the
        ``dhp.runtime.actors.stacks.RankStack`` of each rank, read before the teardown) and the driver's
        traceback for this failure; returns the path."""
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
        for st in stacks:
            lines += [f"---- stack of {st.title}", st.text.rstrip(), ""]
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


#: where a fault can fire on a rank: inside the worker method of that part of the step
RANK_POINTS = {
    "produce": "the producer's forward",
    "handoff": "the consumer receiving the hand-off",
    "forward": "the consumer's forward",
    "backward": "the consumer's backward",
    "handback": "the producer receiving its gradient rows (the hand-back) and its backward",
    "grad_sync": "the gradient sync (after its collectives)",
    "optimizer": "the optimizer step",
    "save": "a checkpoint write",
    "save_async": "an asynchronous checkpoint write (after its staging, while it writes)",
}
#: rank points that belong to the step just done (the others belong to the step running)
_AFTER_STEP = {"save", "save_async"}
ACTIONS = ("raise", "hang", "sigterm", "sigint", "delay")
#: how long a ``delay`` fault holds its phase
DELAY_S = 1.0


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``action`` at ``point`` of ``module``'s ``rank`` (None: every rank; module
    ``driver``: the driver, where ``point`` names a worker method: between rank 0's and rank 1's
    submission of it), in ``step`` (None: every step)."""

    action: str
    module: str
    rank: int | None
    point: str
    step: int | None


def parse_faults(text: str) -> list[Fault]:
    """The faults of ``$DHP_INJECT_FAULT``: ``ACTION:WHERE:POINT[:STEP]``, comma-separated.

    ACTION: ``raise`` (NotImplementedError: a deterministic code error), ``hang`` (block in a
    collective the peers never join), ``sigterm`` / ``sigint`` (send that signal to the driver; a
    rank then sleeps 0.5 s, so the driver takes it while the phase still runs), ``delay`` (hold the
    phase ``DELAY_S`` longer: a slow rank, for tests of what runs meanwhile). WHERE:
    ``<module>/<rank>``, ``<module>/*`` or ``driver``. POINT: a key of RANK_POINTS on a rank, a
    worker method's name on the driver. STEP: the k-th step of this process's life, from 1 (a save
    point: the step it saves). A malformed entry is a ValueError (the hook is for tests)."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        parts = item.split(":")
        if len(parts) not in (3, 4) or parts[0] not in ACTIONS:
            raise ValueError(
                f"{FAULT_ENV}: {item!r} is not ACTION:WHERE:POINT[:STEP], ACTION one of {ACTIONS}"
            )
        action, where, point = parts[:3]
        module, _, rank = where.partition("/")
        if module != "driver" and (point not in RANK_POINTS or not (rank == "*" or rank.isdigit())):
            raise ValueError(f"{FAULT_ENV}: {item!r}: a rank's WHERE is <module>/<rank or *>, POINT one of "
                             f"{sorted(RANK_POINTS)}")  # fmt: skip
        step = int(parts[3]) if len(parts) == 4 else None
        out.append(Fault(action, module, None if rank in ("", "*") else int(rank), point, step))
    return out


class FaultHook:
    """The faults of ``$DHP_INJECT_FAULT`` for one process: a rank (``module``, ``rank``) or the
    driver (``module="driver"``). Each fires at most once in the process's life. Unset, ``at`` costs
    one attribute test; nothing here touches placements or memory."""

    def __init__(self, module: str, rank: int | None = None) -> None:
        self.module, self.rank = module, rank
        self.faults = [
            f
            for f in parse_faults(os.environ.get(FAULT_ENV, ""))
            if f.module == module and (f.rank is None or f.rank == rank)
        ]
        self.steps_done = 0
        self._fired: set[int] = set()

    def step_done(self) -> None:
        """One more step of this process's life is complete (its optimizer update applied)."""
        self.steps_done += 1

    def at(self, point: str) -> None:
        """Fire the faults of ``point`` in the current step (see :func:`parse_faults`)."""
        if not self.faults:
            return
        step = self.steps_done + (0 if point in _AFTER_STEP else 1)
        for i, f in enumerate(self.faults):
            if i not in self._fired and f.point == point and f.step in (None, step):
                self._fired.add(i)
                self._fire(f, step=step)

    def _fire(self, f: Fault, *, step: int) -> None:
        what = f"fault injected by {FAULT_ENV}: {f.action} at {f.point}, step {step}"
        if f.action == "raise":
            raise NotImplementedError(what)
        if f.action == "hang":  # the peers finished this call: nobody joins this collective
            torch.distributed.barrier()
            return
        if f.action == "delay":
            time.sleep(DELAY_S)
            return
        sig = signal.SIGTERM if f.action == "sigterm" else signal.SIGINT
        driver = os.getpid() if self.module == "driver" else int(os.environ[FAULT_DRIVER_ENV])
        os.kill(driver, sig)
        if self.module != "driver":
            time.sleep(0.5)  # the driver handles it while this phase still runs
