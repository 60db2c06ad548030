"""Every recipe in recipes/ trains 2 steps on CPU with smoke=true (tiny model, same strategies per
module, degrees scaled to fit 4 gloo ranks). A new recipe is covered automatically."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import ray

from dhp.config import load_config
from dhp.runtime.train import train

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_recipes_are_found():
    assert "tiny_vlm" in RECIPES and len(RECIPES) >= 2


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_smoke_trains_two_steps(ray_local, tmp_path, recipe):
    cfg = load_config(recipe, [f"train.output_dir={tmp_path}"], smoke=True)
    result = train(cfg)
    assert sorted(result.losses) == [1, 2]
    assert all(math.isfinite(v) and v > 0 for v in result.losses.values())
    assert (result.run_dir / "metrics.jsonl").read_text().count("\n") == 2
