"""The planner's pipeline terms (``dhp.plan.pipeline``): per-stage states, bubble, and the plan's rows."""

from __future__ import annotations

import pytest

from dhp.layout import ParallelLayout
from dhp.plan.compile import compile_plan
from dhp.plan.pipeline import bubble_fraction, in_flight_stages, rank_layers
from dhp.validation import load_config

pytestmark = pytest.mark.unit


def test_bubble_per_schedule() -> None:
    def frac(schedule: str, v: int = 1) -> float:
        return bubble_fraction(ParallelLayout(pp=4, pp_virtual=v, pp_schedule=schedule), micro_batches=8)

    assert frac("1f1b") == frac("gpipe") == pytest.approx(3 / 8)
    assert frac("interleaved_1f1b", 2) == pytest.approx(3 / 16)
    assert frac("zero_bubble", 2) == pytest.approx(3 / 48)
    assert bubble_fraction(ParallelLayout(), micro_batches=8) == 0.0


def test_in_flight_and_cut() -> None:
    assert [in_flight_stages("1f1b", pp=4, virtual=1, micro_batches=8, rank=r) for r in range(4)] == [
        4,
        3,
        2,
        1,
    ]
    assert in_flight_stages("gpipe", pp=4, virtual=1, micro_batches=8, rank=3) == 8
    # loop order: rank 0 holds stages 0 and 2 of 4
    assert rank_layers(ParallelLayout(pp=2, pp_virtual=2, pp_schedule="zero_bubble"), 8) == [
        [0, 1, 4, 5],
        [2, 3, 6, 7],
    ]


def test_plan_has_a_row_per_stage_and_splits_the_states() -> None:
    cfg = load_config("qwen_vl_72b_pp", [])
    plan = compile_plan(cfg)
    llm = plan.group("llm")
    assert llm.stage_layers == (20, 20, 20, 20)
    first, last = llm.ranks[0].memory, llm.ranks[-1].memory
    whole = compile_plan(load_config("qwen_vl_72b_pp", ["modules.llm.parallel.pp=1",
                         "modules.llm.parallel.fsdp=2", "modules.llm.parallel.pp_virtual=1",
                         "modules.llm.parallel.pp_schedule=1f1b"])).group("llm").ranks[0].memory  # fmt: skip
    # each pipeline rank holds half the layers; with FSDP=2 instead each rank holds half of every one
    assert first.params + last.params == pytest.approx(2 * whole.params, rel=1e-3)
    assert plan.estimate["modules"]["llm"]["pp_bubble_s"] > 0
    assert plan.to_json()["groups"][1]["pipeline"]["schedule"] == "zero_bubble"
