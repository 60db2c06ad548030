"""SIGTERM and Ctrl-C to `dhp train` (a real CLI process, its own Ray): the step running ends, a
checkpoint at that step boundary, Ray shut down, exit 128 + the signal, no process left behind.

The fast case sends SIGTERM in the window that used to hang the run: between the two vision ranks'
submissions of their forward (``DHP_INJECT_FAULT=sigterm:driver:produce:2``). A signal that
raised there left rank 0 inside Ulysses' all-to-all waiting for rank 1, which never got the call;
every later call (the interrupt's cleanup, the save) queued behind it and the driver waited
forever. The slow case sends a real Ctrl-C at whatever moment the run is in after step 2. Every
part of a step, both placements, the second signal and the resume: test_interrupt_phases.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from interrupts import STOP_BOUND_S, checkpoints, logged
from procs import alive, descendants

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _start(tmp_path, name: str, *, fault: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dhp.cli", "train", "conf=tiny_vlm", f"name={name}"]
    cmd += [f"train.output_dir={tmp_path}", "train.steps=200", "train.checkpoint_every=0"]
    # as a user's shell has it: Ray picks the auth mode (a Ray started in this process set it here)
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    if fault:
        env["DHP_INJECT_FAULT"] = fault
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # a suite started in the background (`cmd &`) inherits SIGINT ignored, and Python keeps an
        # ignored SIGINT ignored: give the run a terminal's default so Ctrl-C is what it receives
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _finish(proc: subprocess.Popen, seen: set[int], *, timeout_s: float = 400) -> str:
    """Wait for the run (noting its process tree on the way); kill it if it outlives ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update(descendants(proc.pid))
            time.sleep(0.3)
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        return out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _check_stopped(run_dir: Path, out: str, seen: set[int], sig: signal.Signals) -> float:
    """One complete checkpoint at the last logged step, no temp dir, no process left; the seconds
    from the signal to the line that ends the run."""
    done, other = checkpoints(run_dir)
    assert len(done) == 1 and not other, (done, other, out[-3000:])
    ckpt = run_dir / "checkpoints" / f"step_{done[0]:06d}"
    assert json.loads((ckpt / "meta.json").read_text())["step"] == done[0] == max(logged(run_dir)) >= 2
    assert (ckpt / "manifest.json").is_file()
    said = re.search(rf"interrupted after step {done[0]} \((\d+\.\d) s after {sig.name}\): saved", out)
    assert said, out[-3000:]
    time.sleep(5)  # Ray's processes exit asynchronously after shutdown
    left = sorted(p for p in seen if alive(p))
    assert not left, f"orphans: {[(p, Path(f'/proc/{p}/cmdline').read_bytes()[:80]) for p in left]}"
    return float(said.group(1))


@pytest.mark.slow
def test_sigterm_between_two_ranks_submissions_saves_and_exits_143(tmp_path) -> None:
    seen: set[int] = set()
    t0 = time.monotonic()
    proc = _start(tmp_path, "term", fault="sigterm:driver:produce:2")
    out = _finish(proc, seen)
    took = time.monotonic() - t0
    assert proc.returncode == 143, out[-3000:]
    assert "Token authentication is enabled" not in out  # dhp's own local Ray: the notice is dropped
    assert "SIGTERM: finishing the running step" in out, out[-3000:]
    (run_dir,) = (tmp_path / "term").iterdir()
    stop_s = _check_stopped(run_dir, out, seen, signal.SIGTERM)
    assert stop_s < STOP_BOUND_S, stop_s
    print(f"run {took:.1f} s, signal to the end of the run {stop_s:.1f} s")


@pytest.mark.slow
def test_ctrl_c_at_any_moment_saves_and_leaves_no_orphans(tmp_path) -> None:
    seen: set[int] = set()
    proc = _start(tmp_path, "int")
    try:
        deadline = time.monotonic() + 400
        while True:
            seen.update(descendants(proc.pid))
            rows = list(tmp_path.glob("int/*/metrics.jsonl"))
            if rows and rows[0].read_text().count("\n") >= 2:
                break
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 2"
            time.sleep(0.5)
        seen.update(descendants(proc.pid))
        os.kill(proc.pid, signal.SIGINT)
        out = _finish(proc, seen, timeout_s=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out[-3000:]
    (run_dir,) = (tmp_path / "int").iterdir()
    assert _check_stopped(run_dir, out, seen, signal.SIGINT) < STOP_BOUND_S


@pytest.mark.slow
def test_ctrl_c_stops_pytest_after_an_in_process_run_saved(tmp_path) -> None:
    """`make test` on Ctrl-C: a test that calls train() in pytest's own process gets the graceful
    stop (the step ends, a checkpoint), then pytest's KeyboardInterrupt, so the session stops there
    instead of failing that one test and going on with the next."""
    runs = tmp_path / "runs"
    (tmp_path / "test_child.py").write_text(
        "import io\n"
        "from rich.console import Console\n"
        "from dhp.runtime.loop.train import train\n"
        "from dhp.validation import load_config\n\n"
        "def test_trains():\n"
        f"    cfg = load_config('tiny_vlm', ['name=c', 'train.output_dir={runs}', 'train.steps=50'])\n"
        "    train(cfg, console=Console(file=io.StringIO()))\n\n"
        "def test_after():\n"
        f"    open('{tmp_path / 'ran_after'}', 'w').close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env |= {"DHP_INJECT_FAULT": "sigint:driver:produce:2", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_child.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    out = proc.stdout + proc.stderr
    # pytest's Ctrl-C exit (2, "interrupted"), named by the KeyboardInterrupt the run raised
    assert proc.returncode == 2 and "! dhp.runtime.loop.interrupts.RunInterrupted: interrupted" in out, out[
        -3000:
    ]
    assert not (tmp_path / "ran_after").exists()  # the session stopped at the interrupted test
    (run_dir,) = (runs / "c").iterdir()
    done, _ = checkpoints(run_dir)
    assert done == [max(logged(run_dir))] and done[0] >= 2  # saved at the step boundary first
