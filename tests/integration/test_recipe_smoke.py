"""Every recipe in recipes/ trains 2 steps on CPU with smoke=true (tiny model, same strategies per
module, degrees scaled to fit 4 gloo ranks). A new recipe is covered automatically. The SFT recipes
(``sft_*``) train on the user's data: their smoke runs, on a tiny checkpoint of the family and a real
LLaMA-Factory file, are tests/integration/test_sft_recipes.py's.

Recipes whose smoke configs are identical (apart from the name and description) shrink to the same
run, so only the first of each such set trains; every recipe still loads and shrinks here, and the
test below says which recipe covers which.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dhp.runtime.loop.train import train
from dhp.validation import load_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
SFT = [r for r in RECIPES if r.startswith("sft_")]  # trained by test_sft_recipes.py


def _smoke_key(recipe: str) -> str:
    """The smoke run a recipe shrinks to, as canonical JSON without its name and description."""
    cfg = OmegaConf.to_container(load_config(recipe, [], smoke=True), resolve=True)
    assert isinstance(cfg, dict)
    cfg.pop("name"), cfg.pop("description")
    return json.dumps(cfg, sort_keys=True, default=str)


@functools.cache
def _representatives() -> dict[str, list[str]]:
    """First recipe of each distinct smoke run -> the recipes that shrink to the same run."""
    seen: dict[str, str] = {}
    covers: dict[str, list[str]] = {}
    for recipe in RECIPES:
        if recipe in SFT:
            continue
        rep = seen.setdefault(_smoke_key(recipe), recipe)
        covers.setdefault(rep, []).append(recipe)
    return covers


def _selected(config: pytest.Config) -> bool:
    """Whether ``-m`` keeps this module's tests (marked integration and slow). The representatives
    cost one Hydra composition per recipe (~7 s), spent at collection only when the smoke runs can
    be selected: ``make test-fast`` deselects them."""
    expr = config.getoption("markexpr")
    if not expr:
        return True
    try:  # pytest's own -m evaluator; on a pytest without it, compute (the safe side)
        from _pytest.mark.expression import Expression

        return Expression.compile(expr).evaluate(lambda name, **_: name in {"integration", "slow"})
    except Exception:
        return True


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "recipe" in metafunc.fixturenames:
        reps = sorted(_representatives()) if _selected(metafunc.config) else ["tiny_vlm"]
        metafunc.parametrize("recipe", reps)


def test_recipes_are_found_and_each_is_covered_by_one_smoke_run():
    assert "tiny_vlm" in RECIPES and len(RECIPES) >= 2
    covered = sorted([*SFT, *(r for rs in _representatives().values() for r in rs)])
    assert covered == RECIPES and SFT
    for recipe in SFT:  # each still shrinks to a valid smoke run without weights or data
        assert load_config(recipe, [], smoke=True).data.kind == "synthetic"


def test_recipe_smoke_trains_two_steps(ray_local, tmp_path, recipe):
    cfg = load_config(recipe, [f"train.output_dir={tmp_path}"], smoke=True)
    result = train(cfg)
    assert sorted(result.losses) == [1, 2]
    assert all(math.isfinite(v) and v > 0 for v in result.losses.values())
    assert (result.run_dir / "metrics.jsonl").read_text().count("\n") == 2
