"""Rules that had several copies now have one: the search ranks with the estimate's time model
(hand-off and video included), a plan's bundle total, and when a checkpoint is due."""

from __future__ import annotations

import pytest

from dhp.config.schema import TrainConfig
from dhp.plan.compile import compile_plan
from dhp.plan.search import Search, apply
from dhp.plan.types import bundle_total
from dhp.runtime.loop.train import _checkpoint_due
from dhp.validation import load_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("recipe", "overrides", "placement"),
    [
        ("tiny_vlm", ["train.micro_batch_size=2"], "disaggregated"),
        ("tiny_qwen3_vl", ["placement=collocated", "train.micro_batch_size=2"], "collocated"),
        ("tiny_vlm_video", ["placement=collocated", "train.micro_batch_size=2"], "collocated"),
    ],
)
def test_search_ranks_with_the_estimate(recipe: str, overrides: list[str], placement: str) -> None:
    """The step time the search ranks a candidate by is the estimate of the plan it writes, to the
    last digit: the same per-module time assembly, hand-off (each placement's) and video patches."""
    overrides = [*overrides, *(f"modules.{m}.activation_checkpointing=off" for m in ("vision", "llm"))]
    cfg = load_config(recipe, overrides)
    cands = [c for c in Search(cfg, {o.split("=")[0] for o in overrides}).run() if c.placement == placement]
    assert cands
    for cand in cands[:2]:
        plan = compile_plan(apply(cfg, cand.overrides()))
        est = plan.estimate
        assert cand.step_s == pytest.approx(est["step_time_s"], rel=1e-9), cand.label()
        assert cand.vision.time["handoff_s"] == pytest.approx(est["handoff_s"], rel=1e-9)
        assert est["handoff_s"] > 0


def test_bundle_total_and_plan_resources() -> None:
    assert bundle_total([{"CPU": 0.25, "GPU": 0.5}, {"CPU": 0.25}, {"GPU": 0.5}]) == {"CPU": 0.5, "GPU": 1.0}
    plan = compile_plan(load_config("tiny_vlm", []), estimate=False)
    assert plan.resources == bundle_total(b for pg in plan.placement_groups for b in pg.bundles)
    assert plan.resources["CPU"] > 0


def test_checkpoint_due() -> None:
    t = TrainConfig(steps=10, checkpoint_every=4)
    assert [s for s in range(1, 11) if _checkpoint_due(t, s)] == [4, 8, 10]
    assert [s for s in range(1, 11) if _checkpoint_due(TrainConfig(steps=10, checkpoint_every=0), s)] == [10]
