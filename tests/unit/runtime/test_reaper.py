"""The Ray-session watchdog on real processes (no Ray): a "driver" starts a tree of processes that
name a fake session on their command line (as the GCS and the raylet do) plus a grandchild (as an
actor under the raylet) and an unrelated child; the driver is SIGKILLed and the watchdog must
remove the session's processes within 10 s and leave the unrelated one alone. When the session
ends while the driver lives (ray.shutdown), the watchdog exits by itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dhp.runtime.launch.reaper import _alive, start_reaper

pytestmark = pytest.mark.unit

DRIVER = r"""
import subprocess, sys, time
sess, root = sys.argv[1], sys.argv[2]
# a "raylet" (names the session) whose child (an "actor") does not
raylet = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; subprocess.Popen(['sleep', '300']); time.sleep(300)", sess])
other = subprocess.Popen(["sleep", "301"])
sys.path.insert(0, root + "/dhp/runtime/launch")  # the watchdog's module alone: stdlib only, no torch
from reaper import start_reaper
print(raylet.pid, other.pid, start_reaper(sess), flush=True)
time.sleep(300)
"""


def _kids(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc only")
def test_driver_sigkill_removes_the_session_within_10_s(tmp_path) -> None:
    session = f"session_test_{os.getpid()}_{time.time_ns()}"
    root = str(Path(__file__).resolve().parents[3])
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, session, root],
        stdout=subprocess.PIPE,
        text=True,
    )
    raylet, other, reaper = (int(x) for x in driver.stdout.readline().split())
    actor = None
    try:
        deadline = time.monotonic() + 10
        while not _kids(raylet) and time.monotonic() < deadline:
            time.sleep(0.05)
        (actor,) = _kids(raylet)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        t0 = time.monotonic()
        while any(_alive(p) for p in (raylet, actor, reaper)) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert not any(_alive(p) for p in (raylet, actor)), "session processes outlived the driver by 10 s"
        assert not _alive(reaper)  # its job done, the watchdog is gone too
        assert _alive(other)  # not of the session: left alone
    finally:
        for p in (driver.pid, raylet, actor, other):
            if p is not None and _alive(p):
                os.kill(p, signal.SIGKILL)


def test_watchdog_exits_when_the_session_ends_first() -> None:
    session = f"session_test_{os.getpid()}_{time.time_ns()}"
    member = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", session])
    pid = start_reaper(session)
    assert pid is not None and _alive(pid)
    member.kill()
    member.wait()
    t0 = time.monotonic()
    while _alive(pid) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert not _alive(pid)
