"""Ctrl-C (SIGINT to the driver) during `dhp train`: a checkpoint is saved (train.save_on_interrupt),
Ray is shut down, the exit status is 130 and no process of the run is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import alive, descendants

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_ctrl_c_saves_and_leaves_no_orphans(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "dhp.cli",
        "train",
        "conf=tiny_vlm",
        "name=int",
        f"train.output_dir={tmp_path}",
    ]
    cmd += ["train.steps=200", "train.checkpoint_every=0", *("placement=disaggregated", "modules.llm.gpus=1")]
    cmd += ["modules.llm.parallel.tp=1"]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # a suite started in the background (`cmd &`) inherits SIGINT ignored, and Python keeps an
        # ignored SIGINT ignored: give the run a terminal's default so Ctrl-C is what it receives
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen: set[int] = set()
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
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out[-3000:]
    (run_dir,) = (tmp_path / "int").iterdir()
    (ckpt,) = (run_dir / "checkpoints").iterdir()
    meta = json.loads((ckpt / "meta.json").read_text())
    logged = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert meta["step"] >= max(logged) >= 2 and ckpt.name == f"step_{meta['step']:06d}"
    time.sleep(5)  # Ray's processes exit asynchronously after shutdown
    left = sorted(p for p in seen if alive(p))
    assert not left, f"orphans: {[(p, Path(f'/proc/{p}/cmdline').read_bytes()[:80]) for p in left]}"


def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path):
    """SIGTERM (what Slurm and Kubernetes send before SIGKILL) is the first Ctrl-C: a checkpoint at
    the step boundary, a clean shutdown, exit status 128 + 15, no temp dir left."""
    cmd = [
        sys.executable,
        "-m",
        "dhp.cli",
        "train",
        "conf=tiny_vlm",
        "name=term",
        f"train.output_dir={tmp_path}",
    ]
    cmd += ["train.steps=200", "train.checkpoint_every=0", "placement=disaggregated", "modules.llm.gpus=1"]
    cmd += ["modules.llm.parallel.tp=1"]
    # as a user's shell has it: Ray picks the auth mode (a Ray started in this process set it here)
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 400
        while True:
            rows = list(tmp_path.glob("term/*/metrics.jsonl"))
            if rows and rows[0].read_text().count("\n") >= 2:
                break
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 2"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, out[-3000:]
    assert "Token authentication is enabled" not in out  # dhp's own local Ray: the notice is dropped
    (run_dir,) = (tmp_path / "term").iterdir()
    (ckpt,) = (run_dir / "checkpoints").iterdir()  # one complete checkpoint, no *.tmp-* dir
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["step"] >= 2 and ckpt.name == f"step_{meta['step']:06d}"
    assert (ckpt / "manifest.json").is_file()
