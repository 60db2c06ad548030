"""`dhp calibrate` recovers known efficiencies from run directories whose timings the model made,
and writes a profile that `cluster=NAME` loads and `dhp plan` names."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from dhp.config.loader import CONF_DIR
from dhp.plan import compile_plan
from dhp.plan.calibrate import PRIOR_WEIGHT, calibrate, fit, run_observations
from dhp.plan.estimate import FEATURES, seconds
from dhp.validation import load_config

pytestmark = pytest.mark.unit

RECIPES = CONF_DIR.parent / "recipes"
TRUE = {
    "matmul": 1 / 0.31,
    "attention": 1 / 0.12,
    "comm": 1 / 0.55,
    "memory": 1 / 0.6,
    "calls": 0.004,
    "dispatch": 0.01,
    "blocks": 0.001,
    "dtensor_blocks": 0.002,
    "fsdp_blocks": 0.0015,
    "attention_calls": 1e-4,
    "collectives": 5e-4,
    "tensors": 2e-4,
}


def _fake_run(tmp_path, name: str, overrides: list[str]):
    """A run dir whose metrics are exactly what the model predicts under TRUE (3 identical steps)."""
    cfg = load_config("tiny_vlm", [f"name={name}", *overrides])
    d = tmp_path / name
    d.mkdir()
    (d / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    rec = {"step_s": 1.0}
    for feats, _, label in run_observations(
        cfg,
        [{"step_s": 0.0} | {f"{m}_{p}_s": 1.0 for m in ("vision", "llm") for p in ("fwd", "bwd", "step")}],
    ):
        rec[f"{label}_s"] = seconds(feats, TRUE)
    (d / "metrics.jsonl").write_text("\n".join(json.dumps({**rec, "step": s}) for s in (1, 2, 3)))
    return d


def test_fit_recovers_coefficients_and_keeps_priors() -> None:
    rows = [
        ({"matmul": 1.0, "attention": 0.5, "comm": 0.0, "memory": 0.2, "calls": 1.0}, 0.0, "a"),
        ({"matmul": 0.2, "attention": 2.0, "comm": 0.0, "memory": 0.1, "calls": 1.0}, 0.0, "b"),
        ({"matmul": 3.0, "attention": 0.1, "comm": 0.0, "memory": 1.0, "calls": 2.0}, 0.0, "c"),
        ({"matmul": 0.0, "attention": 0.0, "comm": 0.0, "memory": 4.0, "calls": 1.0}, 0.0, "d"),
        ({"matmul": 1.5, "attention": 1.5, "comm": 0.0, "memory": 0.0, "calls": 3.0}, 0.0, "e"),
    ]
    obs = [(f, seconds(f, TRUE), label) for f, _, label in rows]
    prior = dict.fromkeys(FEATURES, 7.0)
    got = fit(obs, prior, prior_weight=0.0)
    for k in ("matmul", "attention", "memory", "calls"):
        assert got[k] == pytest.approx(TRUE[k], rel=1e-6)
    assert got["comm"] == got["dispatch"] == got["tensors"] == 7.0  # no observation has them: priors stay


def test_prior_decides_what_the_runs_cannot_tell_apart() -> None:
    """Attention FLOPs and attention calls that grow together in every run: the data fix only their
    sum. Unanchored, the fit lands on some split of it (here away from the true one); anchored, the
    prior's split, which the data agree with exactly, wins. A coefficient the runs do determine
    still moves off a wrong prior."""
    rows = [
        ({"matmul": 1.0, "attention": a, "attention_calls": 5e4 * a, "calls": 1.0}, 0.0, f"r{a}")
        for a in (0.1, 0.4, 1.0, 2.5)
    ]
    rows += [({"matmul": m, "calls": 1.0}, 0.0, f"m{m}") for m in (0.5, 3.0)]
    obs = [(f, seconds(f, TRUE), label) for f, _, label in rows]
    prior = {**TRUE, "matmul": 2 * TRUE["matmul"]}  # matmul prior wrong by 2x, the rest right
    free = fit(obs, prior, prior_weight=0.0)
    assert abs(free["attention"] / TRUE["attention"] - 1) > 0.1  # the data alone cannot tell
    anchored = fit(obs, prior, prior_weight=PRIOR_WEIGHT)
    assert anchored["attention"] == pytest.approx(TRUE["attention"], rel=0.05)
    assert anchored["attention_calls"] == pytest.approx(TRUE["attention_calls"], rel=0.05)
    # matmul: six rows against one prior observation pull it more than halfway to the truth
    assert 1.0 < anchored["matmul"] / TRUE["matmul"] < 1.5
    assert 1.0 < fit(obs, prior, prior_weight=0.5)["matmul"] / TRUE["matmul"] < 1.15


@pytest.mark.slow  # a calibration's profile file end to end; the fit's rules stay in the fast tier
def test_calibrate_writes_a_profile_that_cluster_names(tmp_path) -> None:
    runs = [
        _fake_run(tmp_path, "a", []),
        _fake_run(
            tmp_path,
            "b",
            [
                "placement=disaggregated",
                "modules.vision.gpus=1",
                "modules.vision.parallel.sp=1",
                "modules.llm.gpus=1",
                "modules.llm.parallel.tp=1",
            ],
        ),
        _fake_run(
            tmp_path,
            "c",
            [
                "modules.vision.activation_checkpointing=full",
                "data.synthetic.patches=1024",
                "modules.vision.seq_len=2048",
                "modules.llm.seq_len=320",
            ],
        ),
    ]
    out = tmp_path / "cluster" / "fitted_cpu.yaml"
    report = calibrate([str(r) for r in runs], out=str(out), prior_weight=0.0)
    prof = report["profile"]
    assert prof["provenance"] == "calibrated on this cluster, 3 runs"  # overrides the anchored one
    assert prof["matmul_efficiency"] == pytest.approx(0.31, rel=1e-6)
    assert prof["call_overhead_s"] == pytest.approx(0.004, rel=1e-6)
    for o in report["observations"]:
        assert o["fitted_s"] == pytest.approx(o["measured_s"], rel=1e-6)
    recipe = tmp_path / "run.yaml"  # a recipe next to cluster/: Hydra finds cluster=fitted_cpu there
    recipe.write_text((RECIPES / "tiny_vlm.yaml").read_text())
    plan = compile_plan(load_config(str(recipe), ["cluster=fitted_cpu"]))
    assert plan.estimate["profile"].startswith("calibrated: ")
