"""The tooling around runs, through the real CLI: a multirun sweep, ``dhp runs``, ``dhp report``,
``dhp --version`` and the help text.

One sweep is shared by the module: ``dhp train conf=tiny_vlm -m train.lr=1e-3,2e-3,-1
train.steps=2`` (every degree 1, one local Ray for the members). ``lr=-1`` is invalid, so the third
member fails with a ConfigError: it is reported and the sweep still finishes the two good runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from plans import ALL_ONE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _dhp(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dhp.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"COLUMNS": "200", **__import__("os").environ},
    )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    proc = _dhp(
        "train",
        "conf=tiny_vlm",
        "-m",
        "train.lr=1e-3,2e-3,-1",
        "train.steps=2",
        "name=sw",
        f"train.output_dir={out}",
        *ALL_ONE,
    )
    return out, proc


def test_sweep_makes_one_run_dir_per_member_and_a_summary(sweep):
    out, proc = sweep
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-4000:]  # one member failed
    runs = sorted((out / "sw").iterdir())
    assert len(runs) == 2, runs
    assert [yaml.safe_load((r / "config.yaml").read_text())["train"]["lr"] for r in runs] == [1e-3, 2e-3]
    (sweep_file,) = (out / "sweeps").glob("*/sweep.jsonl")
    members = [json.loads(x) for x in sweep_file.read_text().splitlines()]
    assert [m["swept"] for m in members] == [{"train.lr": "0.001"}, {"train.lr": "0.002"}, {"train.lr": "-1"}]
    assert [m["status"] for m in members] == ["ok", "ok", "failed"]
    assert "ConfigError" in members[2]["error"] and "train.lr" in members[2]["error"]
    for m, run in zip(members[:2], runs, strict=True):
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert m["run_dir"] == str(run) and m["steps"] == 2
        assert m["final_loss"] == rows[-1]["loss"]
        assert m["peak_mem_bytes"] == max(v for r in rows for v in r["peak_mem_bytes"].values())
        assert m["tokens_per_s_vision"] > 0 and m["tokens_per_s_text"] > 0
    assert "sweep summary" in text and "failed" in text
    assert text.count("Started a local Ray instance") == 1, "the members share one Ray"


def test_dhp_runs_lists_each_run(sweep):
    out, _ = sweep
    proc = _dhp("runs", str(out))
    assert proc.returncode == 0, proc.stderr
    for run in (out / "sw").iterdir():
        assert run.name in proc.stdout
    assert proc.stdout.count("finished") == 2 and proc.stdout.count("2/2") == 2, proc.stdout


def test_dhp_report_writes_its_pngs(sweep, tmp_path):
    out, _ = sweep
    run = sorted((out / "sw").iterdir())[0]
    proc = _dhp("report", str(run), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == sorted(
        [
            "loss.png",
            "grad_norm.png",
            "learning_rate.png",
            "tokens_per_s.png",
            "time_split.png",
            "peak_memory_per_rank.png",
        ]
    )
    for p in tmp_path.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
    assert "peak memory vision/0" in proc.stdout and "restarts" in proc.stdout


def test_version_and_clean_help():
    from dhp import __version__

    v = _dhp("--version", timeout=120)
    assert v.returncode == 0 and v.stdout.strip() == f"dhp {__version__}"
    for args in (["--help"], ["plan", "--help"], ["train", "--help"]):
        h = _dhp(*args, timeout=120)
        assert h.returncode == 0 and "<bool>" not in h.stdout, h.stdout
    assert "--install-completion" in _dhp("--help", timeout=120).stdout
