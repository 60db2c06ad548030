"""SIGINT and SIGTERM during ``dhp train``: what each signal does in each part of a run.

SIGTERM is what Slurm and Kubernetes send before a kill; it means the same as Ctrl-C. The first
signal never cuts a step: a step's calls reach every rank of every group or none (a call that
reached some ranks of a group leaves the others' collectives waiting forever). The run writes a
checkpoint at the step boundary and exits ``128 + signal`` (130, 143). Before the step loop nothing
has run that a checkpoint could keep, so the first signal stops at once. A second one stops at
once without a checkpoint (the previous one stays the newest); a third ends the process. Nothing
here touches placements or memory.

In a caller's own process (a test, a notebook, a script calling ``dhp.runtime.loop.train.train``) a
Ctrl-C still ends the caller after the graceful stop: when the SIGINT handler before the run was
Python's own (``signal.default_int_handler``), the run raises :class:`RunInterrupted` (a
``KeyboardInterrupt`` carrying the run's result) once it has stopped, saved and torn down, so
pytest stops as it does on any Ctrl-C. A caller with a handler of its own (the CLI's) gets the
result back and reads ``result.signal``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any


class HardStop(BaseException):
    """A second Ctrl-C or SIGTERM: stop at once, no checkpoint."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a run whose caller had Python's default SIGINT handling: raised after the
    graceful stop (checkpoint, teardown); ``result`` is what the run returned."""

    def __init__(self, result: Any) -> None:
        super().__init__(f"interrupted; run dir {getattr(result, 'run_dir', None)}")
        self.result = result


class Signals:
    """SIGINT/SIGTERM of the run, in one of three modes (``mode``):

    - ``raise`` (before the step loop: Ray start, the actors' start and build, resume, a restart's
      backoff): the first signal raises KeyboardInterrupt; nothing has run that a checkpoint
      could keep, so the run stops at once.
    - ``defer`` (the step loop): the first signal only asks for a stop (``requested``); it never
      raises inside a step, so every call of the running step reaches every rank. The step runs to
      its end (its waits bounded by ``train.step_timeout_s``), the loop writes a checkpoint at that
      step boundary and ends. The second raises HardStop: stop at once, no checkpoint; inside
      ``held()`` (a checkpoint's commit) it is raised when the commit is done.
    - ``quiet`` (the teardown): signals are counted, nothing is raised.

    A third signal, in any mode, ends the process at once (``os._exit``; the reaper of a local Ray
    still stops its processes)."""

    def __init__(self, result: Any) -> None:
        self.result, self.count, self.mode = result, 0, "raise"
        self._held, self._hard = 0, False

    @property
    def requested(self) -> bool:
        """A stop was asked for (at least one signal)."""
        return self.count > 0

    def handler(self, signum: int, frame) -> None:
        self.count += 1
        if self.result.signal is None:
            self.result.signal, self.result.signal_time = signum, time.monotonic()
        if self.count >= 3:
            os._exit(128 + self.result.signal)
        if self.mode == "raise" and self.count == 1:
            self.mode = "quiet"  # the stop is under way: a second signal adds nothing
            raise KeyboardInterrupt
        if self.mode != "defer":
            return
        name = signal.Signals(signum).name
        if self.count == 1:
            _say(
                f"{name}: finishing the running step, then a checkpoint and exit ({name} again: stop at once, no checkpoint)"
            )
            return
        self.mode = "quiet"
        if self._held:
            self._hard = True
            return
        raise HardStop

    @contextlib.contextmanager
    def held(self):
        """A section a second signal does not cut (a checkpoint's commit: files, then one rename)."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if not self._held and self._hard:
                self._hard = False
                raise HardStop

    def reinstall(self) -> None:
        """Take SIGTERM back after ``ray.init`` (Ray's core worker installs a crash handler for it
        that aborts the driver with exit 134)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.handler)


@contextlib.contextmanager
def run_signals(result: Any):
    """Install the SIGINT/SIGTERM handlers for the run (main thread only); restore them after.

    When the body returns after a Ctrl-C and the SIGINT handler before was Python's default, raise
    :class:`RunInterrupted` (the caller sees its KeyboardInterrupt after the graceful stop)."""
    sig = Signals(result)
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
    if result.signal == signal.SIGINT and old[signal.SIGINT] is signal.default_int_handler:
        raise RunInterrupted(result)


def _say(line: str) -> None:
    """One line on stderr from a signal handler: a raw write (the main thread may be inside a print
    to the same stream, which a second buffered write would refuse)."""
    with contextlib.suppress(OSError):
        os.write(2, f"\n{line}\n".encode())
