"""A watchdog that removes a local Ray instance's processes when its driver dies without shutting
Ray down (SIGKILL, OOM kill, a crash): without it the GCS, the raylet and the actors linger for a
minute or more, holding memory and CPUs.

The driver starts it right after starting its local Ray (:func:`start_reaper`); it runs as a
separate, tiny process (its own session, so a Ctrl-C at the terminal does not reach it; it imports
nothing but the standard library). Every ``POLL_S`` it checks the driver: when the driver is gone
(or its pid was reused), it finds the session's root processes (the ones whose command line names
the Ray session, e.g. the GCS server and the raylet) and every process below them (the actors and
idle workers), sends SIGTERM, and SIGKILL to whatever is left ``GRACE_S`` later. When the driver
shut Ray down itself (no root left), the watchdog just exits. Linux only (/proc); elsewhere
``start_reaper`` does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.5
GRACE_S = 2.0


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name (state first), or None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (with the pid, a unique identity)."""
    st = _stat(pid)
    return None if st is None else st[19]


def _alive(pid: int, started: str | None = None) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z" and (started is None or st[19] == started)


def _table() -> tuple[dict[int, list[int]], dict[int, bytes]]:
    """(children by parent pid, command line by pid) of every process now."""
    children: dict[int, list[int]] = {}
    cmdlines: dict[int, bytes] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        pid = int(d.name)
        st = _stat(pid)
        if st is None:
            continue
        children.setdefault(int(st[1]), []).append(pid)
        try:
            cmdlines[pid] = (d / "cmdline").read_bytes()
        except OSError:
            cmdlines[pid] = b""
    return children, cmdlines


def _holds_session_file(pid: int, session: str) -> bool:
    """True if ``pid`` has a file of the session open (every Ray process logs into the session dir;
    the agents re-parented away from the raylet are found this way)."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if session in os.readlink(fd):
                return True
        except OSError:
            continue
    return False


def session_processes(session: str, *, exclude: set[int]) -> list[int]:
    """Pids of the processes whose command line names ``session`` or that hold one of its files
    open, and all their descendants."""
    children, cmdlines = _table()
    key = session.encode()
    roots = [
        p
        for p, c in cmdlines.items()
        if p not in exclude and (key in c or (c.startswith(b"ray::") and _holds_session_file(p, session)))
    ]
    out, todo, seen = [], list(roots), set(exclude)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def reap(session: str, *, exclude: set[int]) -> list[int]:
    """SIGTERM every process of ``session``, SIGKILL the rest after ``GRACE_S``; returns the pids.
    A pid is signalled only while it is the same process (start time), never a reused one."""
    found = [(p, start_time(p)) for p in session_processes(session, exclude=exclude)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, started in found:
            if _alive(pid, started):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + GRACE_S
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(_alive(*f) for f in found):
            time.sleep(0.1)
    return [p for p, _ in found]


def watch(driver: int, started: str, session: str) -> None:
    """Poll until the driver is gone (then reap the session) or the session is gone (then exit)."""
    me = {os.getpid()}
    while True:
        time.sleep(POLL_S)
        if not _alive(driver, started):
            for _ in range(3):  # again, for anything the session spawned while it was being reaped
                if not reap(session, exclude=me | {driver}):
                    break
            return
        if not session_processes(session, exclude=me | {driver}):
            return  # the driver shut its Ray down


def start_for_local_ray() -> int | None:
    """Start the watchdog for the local Ray this process (the driver) just started; its pid, or None
    (no /proc, or no session known)."""
    import ray  # the watchdog process itself imports only the standard library (module docstring)

    node = getattr(ray._private.worker, "_global_node", None)  # Ray's own record of the session
    return start_reaper(getattr(node, "session_name", "") or "")


def start_reaper(session: str) -> int | None:
    """Start the watchdog for this process (the driver) and its local Ray ``session``; its pid, or
    None where /proc is missing."""
    me = os.getpid()
    started = start_time(me)
    if started is None or not session:
        return None
    proc = subprocess.Popen(
        [sys.executable, "-S", "-E", str(Path(__file__).resolve()), str(me), started, session],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    return proc.pid


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2], sys.argv[3])
