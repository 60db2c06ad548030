"""`--auto`'s search space holds selective AC and the LLM's sequence parallelism, keeps what the user
fixed, holds every recipe's own plan that fits, says why it found nothing, and its overrides
round-trip through `apply` as typed values."""

from __future__ import annotations

import collections

import pytest

from dhp.config.loader import RECIPES_DIR
from dhp.errors import PlanError
from dhp.plan.compile import compile_plan
from dhp.plan.search import Search, apply, auto_plan, no_plan_message
from dhp.runtime.launch.preflight import checked_config
from dhp.validation import load_config, validate
from dhp.validation.validate import is_missing_input

pytestmark = pytest.mark.unit


def test_search_space_has_selective_ac_and_llm_sequence_parallel() -> None:
    cfg = load_config("tiny_vlm", [])
    search = Search(cfg, set())
    llm = search._degrees("llm", 4)
    assert {d.sequence_parallel for d in llm if d.tp > 1} == {False, True}
    assert not any(d.sequence_parallel for d in llm if d.tp == 1)  # SP-in-TP needs a TP group
    assert not any(d.sequence_parallel for d in search._degrees("vision", 4))
    assert search._acs("llm") == search._acs("vision") == ["off", "selective", "full"]
    with_sp = next(d for d in llm if d.tp == 2 and d.sequence_parallel)
    without = next(d for d in llm if d.tp == 2 and not d.sequence_parallel and d.zero == with_sp.zero)
    assert search._keep("llm", 4, with_sp, "off") and search._keep("llm", 4, without, "off")
    # the recipe sets sequence_parallel: true; fixed on the command line, the plain TP one is dropped
    fixed = Search(cfg, {"modules.llm.parallel.sequence_parallel"})
    assert fixed._keep("llm", 4, with_sp, "off") and not fixed._keep("llm", 4, without, "off")
    # the terms differ: SP-in-TP cuts the LLM's norm/residual activations by tp
    a = search.module("llm", 4, with_sp, "off", 2, 1, 64, 0.0).terms.saved_total
    b = search.module("llm", 4, without, "off", 2, 1, 64, 0.0).terms.saved_total
    assert a < b


@pytest.mark.slow
def test_overrides_apply_as_typed_values() -> None:
    cfg = load_config("tiny_vlm", [])
    best = Search(cfg, set()).run(keep=1)[0]
    out = apply(cfg, best.overrides())
    assert out.modules.llm.parallel.sequence_parallel is best.llm.degrees.sequence_parallel
    assert out.modules.llm.activation_checkpointing == best.llm.ac


def test_search_may_use_fewer_gpus_than_the_cluster() -> None:
    cfg = load_config("tiny_vlm", [])  # local_cpu: 4 CPU slots
    search = Search(cfg, set())
    assert search.totals() == [4, 2, 1]
    places = search.placements()
    assert ("collocated", 4, 4) in places and ("disaggregated", 1, 3) in places
    assert ("collocated", 2, 2) in places and ("disaggregated", 1, 1) in places
    assert ("collocated", 1, 1) in places and not any(v + lw > 4 for p, v, lw in places if p != "collocated")
    fixed = Search(cfg, {"placement"})  # the recipe is collocated: no disaggregated split is tried
    assert {p for p, _, _ in fixed.placements()} == {"collocated"}


def test_oversubscription_counts_every_rank_process_and_the_driver() -> None:
    from dhp.plan.estimate import DRIVER_PROCESSES, busy_processes, oversubscription

    assert DRIVER_PROCESSES == 1.0 and busy_processes(4) == 5.0  # vision and llm 2 ranks each
    cfg = load_config("tiny_vlm", [])  # host_cores: 2
    assert oversubscription(cfg.cluster, 5.0) == 2.5 and oversubscription(cfg.cluster, 1.0) == 1.0
    gpu = load_config("qwen_vl_7b", [])  # host_cores 0: GPUs never share
    assert oversubscription(gpu.cluster, 9.0) == 1.0


RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml") if p.stem != "tiny_vlm_demo")


def _shipped(recipe: str):
    """A recipe as `dhp plan` plans it: an SFT recipe, which takes its user's model.path and data.path,
    as `dhp plan --worst-case` does (every other problem raised)."""
    if recipe.startswith("sft_"):
        return checked_config(recipe, [], say=lambda _line: None, worst_case=True)
    return load_config(recipe, [])


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_recipes_own_plan_is_a_candidate(recipe: str) -> None:
    """Every recipe whose plan fits is in ``--auto``'s space and is one of its candidates, timed and
    sized exactly as ``dhp plan`` does it; ``--auto`` can only return something at least as fast."""
    cfg = _shipped(recipe)
    plan = compile_plan(cfg)
    if not plan.fits or "vision" not in cfg.modules:
        pytest.skip("the recipe's own plan does not fit")
    if len(cfg.modules) > 2:  # several encoders: tests/unit/plan/test_plan_n_modules.py
        search = Search(cfg, set())
        own = search.own()
        assert own is not None and own.step_s == pytest.approx(plan.estimate["step_time_s"], rel=1e-9)
        assert own.peak == max(d.total for d in plan.devices)
        return
    search = Search(cfg, set())
    own = search.own()
    assert own is not None
    assert own.step_s == pytest.approx(plan.estimate["step_time_s"], rel=1e-9)
    assert own.peak == max(d.total for d in plan.devices)
    v, lm = own.vision, own.llm
    assert (own.placement, v.world, lm.world) in search.placements()
    assert v.degrees in search._degrees("vision", v.world) and lm.degrees in search._degrees("llm", lm.world)
    assert v.ac in search._acs("vision") and lm.ac in search._acs("llm")
    assert own.micro_batch in search.micro_batches(lm.degrees.num_replicas, v.degrees.num_replicas)
    assert own.vision_seq_len == search.vision_seq_len(own.micro_batch, v.degrees.sp)
    # the overrides rebuild the recipe's plan (an SFT recipe's own files aside, as --worst-case plans it)
    assert not [p for p in validate(apply(cfg, own.overrides())) if not is_missing_input(p)]


LONG_RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*_128k.yaml"))


def test_there_are_long_video_recipes_for_an_moe_and_a_hybrid_model() -> None:
    families = {load_config(r, []).model.family for r in LONG_RECIPES}
    assert {"qwen3_vl_moe", "qwen3_5"} <= families, families


@pytest.mark.slow
@pytest.mark.parametrize("recipe", LONG_RECIPES)
def test_a_long_video_recipe_fits_and_auto_offers_it_with_context_parallelism(recipe: str) -> None:
    """A long-video recipe's own plan fits, uses cp > 1, and is within 3 % of the fastest plan
    ``--auto`` offers (its header says why it keeps its margin over a near-tie); every plan offered
    cuts the LLM's sequence (nothing else fits a row this long). The recipe's placement and AC modes
    are kept fixed, to keep the search short."""
    fixed = {"placement", "modules.vision.activation_checkpointing", "modules.llm.activation_checkpointing"}
    cfg = load_config(recipe, [])
    assert cfg.modules.llm.parallel.cp > 1 and cfg.modules.llm.seq_len >= 128 * 1024
    assert compile_plan(cfg).fits
    offered, _ = auto_plan(cfg, fixed, top=10)
    assert offered and all("modules.llm.parallel.cp=1" not in ov for _, ov in offered)
    own = Search(cfg, fixed).own()
    assert own is not None and own.step_s <= 1.03 * offered[0][0].step_s, (own.label(), offered[0][0].label())


def test_the_search_returns_the_recipes_plan_or_a_faster_one() -> None:
    fixed = {
        "placement",
        "train.micro_batch_size",
        "modules.vision.gpus",
        "modules.vision.activation_checkpointing",
    }
    cfg = load_config("tiny_qwen3_vl_moe", [])
    search = Search(cfg, fixed)  # a smaller space, to keep it fast: the recipe's placement, ...
    found = search.run()
    own = search.own()
    assert own.label() in {c.label() for c in found} and found[0].step_s <= own.step_s


@pytest.mark.slow
def test_auto_finds_a_plan_for_the_30b_at_least_as_fast_as_the_recipe() -> None:
    """qwen3_vl_30b_a3b: the search once wrote every candidate's vision seq_len for a share of the
    patches (per encoder replica) that validation then refused, and found nothing."""
    cfg = load_config("qwen3_vl_30b_a3b", [])
    out, _ = auto_plan(cfg, set(), top=1)
    assert out[0][0].step_s <= compile_plan(cfg).estimate["step_time_s"]


def test_a_search_that_finds_nothing_names_what_ruled_each_class_out() -> None:
    overrides = ["cluster.device_memory_gib=1.05", "placement=disaggregated"]  # less than the reserve
    # cp fixed at the recipe's 1: with cp=3 the 3 LLM GPUs would make one replica, which any batch divides
    fixed = {"placement", "modules.vision.activation_checkpointing", "modules.llm.activation_checkpointing",
             "modules.llm.parallel.cp"}  # fmt: skip
    cfg = load_config("tiny_vlm", overrides)
    with pytest.raises(PlanError) as err:
        auto_plan(cfg, fixed)
    text = str(err.value)
    assert "disaggregated 2:2: none fits memory (smallest peak" in text and "MiB usable)" in text
    assert "disaggregated 1:3: no micro-batch size divides the global batch" in text  # 4 over dp=3
    assert "fewer fixed settings" not in text
    search = Search(cfg, fixed)
    search.run()
    message = no_plan_message(search, collections.Counter({"modules.vision.seq_len: too short": 3}))
    assert "validation refused: modules.vision.seq_len: too short (3x)" in message
    assert "Fix: change the refused setting above" in message
