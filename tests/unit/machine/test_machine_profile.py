"""This machine's profile: a sub-second probe replaces the built-in CPU numbers, and each local run
refines a per-machine cache that the next plan uses and names."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from dhp.machine import machine_profile, probe_machine, record_run
from dhp.machine.cache import ENV
from dhp.plan import compile_plan
from dhp.plan.calibrate import run_observations
from dhp.plan.estimate import seconds
from dhp.validation import load_config

pytestmark = pytest.mark.unit


@pytest.fixture
def on(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "on")
    monkeypatch.setenv("DHP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path


def test_probe_is_quick_and_physical() -> None:
    p = probe_machine()
    assert p.seconds < 5.0  # about 0.5 s on a quiet 2-core box; loaded boxes stretch it
    assert p.matmul_gflops > 0.1 and p.copy_gbps > 0.01
    assert p.allreduce_latency_us > 0 and p.allreduce_gbps > 0


def test_plan_uses_and_names_the_probe(on) -> None:
    cfg = load_config("tiny_vlm", [])
    builtin = compile_plan(cfg).estimate
    assert builtin["provenance"] == "built-in defaults"
    probed = machine_profile(cfg)
    est = compile_plan(probed).estimate
    assert est["provenance"].startswith("profile: this machine, probed")
    assert probed.cluster.peak_bf16_tflops != cfg.cluster.peak_bf16_tflops
    assert cfg.cluster.provenance == "built-in defaults"  # the input config is not changed


def test_off_other_profiles_and_remote_clusters_are_kept(on, monkeypatch) -> None:
    cfg = load_config("tiny_vlm", [])
    anchored = load_config("tiny_vlm", ["cluster.provenance=anchored to 3 public measurements"])
    assert machine_profile(anchored) is anchored
    assert machine_profile(load_config("qwen_vl_7b", [])).cluster.device == "cuda"  # GPUs: untouched
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert machine_profile(cfg) is cfg
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setenv(ENV, "off")
    assert machine_profile(cfg) is cfg


def _run_measured_at(tmp_path, cfg, factor: float, name: str):
    """A run dir of ``cfg`` whose every phase took ``factor`` times what its own plan predicted."""
    coef = {k: v * factor for k, v in _coefficients(cfg).items()}
    d = tmp_path / name
    d.mkdir()
    (d / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    rec = {"step_s": factor * compile_plan(cfg).estimate["step_time_s"]}
    rows = [{"step_s": 0.0} | {f"{m}_{p}_s": 1.0 for m in ("vision", "llm") for p in ("fwd", "bwd", "step")}]
    for feats, _, label in run_observations(cfg, rows):
        rec[f"{label}_s"] = seconds(feats, coef)
    (d / "metrics.jsonl").write_text("\n".join(json.dumps({**rec, "step": s}) for s in (1, 2, 3)))
    return d, rec["step_s"]


def _coefficients(cfg):
    from dhp.plan.estimate import coefficients

    return coefficients(cfg.cluster)


@pytest.mark.slow  # the profile cache's refit: seconds of fitting, no step math
def test_runs_refine_the_cache_and_the_plan_names_them(on) -> None:
    cfg = machine_profile(load_config("tiny_vlm", []))
    first = compile_plan(cfg).estimate["step_time_s"]
    run, measured = _run_measured_at(on, cfg, 3.0, "run1")  # this machine is 3x slower than probed
    line = record_run(run, cfg)
    assert line is not None and "1 run" in line
    again = machine_profile(load_config("tiny_vlm", []))
    est = compile_plan(again).estimate
    assert est["provenance"].startswith("profile: this machine, 1 run")
    # the refined estimate moved from the probe's toward the measured step, and within 1.25x of it
    assert abs(est["step_time_s"] - measured) < abs(first - measured)
    assert measured / 1.25 <= est["step_time_s"] <= measured * 1.25


def test_a_run_on_other_numbers_is_not_recorded(on) -> None:
    cfg = load_config("tiny_vlm", [])  # built-in numbers: not this machine's profile
    run, _ = _run_measured_at(on, cfg, 1.0, "run")
    assert record_run(run, cfg) is None


@pytest.mark.slow  # the profile cache's refit: seconds of fitting, no step math
def test_a_cached_run_this_version_cannot_read_is_left_out_of_the_fit(on) -> None:
    cfg = machine_profile(load_config("tiny_vlm", []))
    old, _ = _run_measured_at(on, cfg, 3.0, "old")
    assert "1 run" in record_run(old, cfg)
    # the cached run's config now holds a key this version does not know (written by another version)
    text = (old / "config.yaml").read_text().replace("  dp: 1\n", "  dp: 1\n  from_the_future: 1\n", 1)
    assert "from_the_future" in text
    (old / "config.yaml").write_text(text)
    new, _ = _run_measured_at(on, cfg, 3.0, "new")
    line = record_run(new, cfg)  # refits on the new run alone instead of failing on the old one
    assert line is not None and "1 run" in line
