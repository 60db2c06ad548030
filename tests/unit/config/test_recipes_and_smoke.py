"""Every recipe composes and validates; smoke mode turns each into a valid 4-rank CPU run."""

from __future__ import annotations

import functools

import pytest
from omegaconf import OmegaConf

from dhp.config import list_recipes
from dhp.config.constants import PARALLEL_AXES
from dhp.config.loader import CONF_DIR, compose_config
from dhp.config.smoke import smoke_config
from dhp.layout import module_layout
from dhp.models.graph import known_consumer
from dhp.plan import compile_plan
from dhp.runtime.launch.preflight import checked_config
from dhp.validation import load_config

pytestmark = pytest.mark.unit

RECIPES = [name for name, _ in list_recipes()]
REQUIRED = {"qwen_vl_32b", "qwen_vl_32b_tp", "qwen_vl_32b_zero3", "qwen_vl_7b", "qwen_vl_72b", "tiny_vlm"}


def test_required_recipes_exist_with_descriptions() -> None:
    assert set(RECIPES) >= REQUIRED
    assert all(desc for _, desc in list_recipes())


@functools.cache
def _full(recipe: str):
    """A recipe as shipped, validated: no weights (tiny_vlm_demo's are written by `make demo`); an SFT
    recipe, which takes the user's model.path and data.path, as `dhp plan --worst-case` checks it
    (every other problem raised). Loaded once per recipe and shared by the tests below: the config is
    read-only (``test_recipe_loads_frozen`` asserts it), so no test can change what another reads."""
    if recipe.startswith("sft_"):
        return checked_config(recipe, ["model.path=null"], say=lambda _line: None, worst_case=True)
    return load_config(recipe, ["model.path=null"])


@functools.cache
def _smoke(recipe: str):
    """``load_config(recipe, [], smoke=True)`` (which validates), once per recipe, read-only as above."""
    return load_config(recipe, [], smoke=True)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_loads_frozen(recipe: str) -> None:
    cfg = _full(recipe)
    assert cfg.name == recipe
    assert OmegaConf.is_readonly(cfg)
    with pytest.raises(Exception, match="read-only"):
        cfg.train.steps = 3


def test_headline_recipe_shape() -> None:
    cfg = load_config("qwen_vl_32b", [])
    assert (cfg.modules.vision.parallel.sp, cfg.modules.llm.parallel.tp) == (8, 8)
    assert cfg.placement == "collocated" and cfg.cluster.gpus_per_node == 8
    tiny = load_config("tiny_vlm", [])
    assert (tiny.modules.vision.parallel.sp, tiny.modules.llm.parallel.tp) == (2, 2)
    assert tiny.cluster.device == "cpu"


def test_overrides_apply() -> None:
    cfg = load_config(
        "qwen_vl_32b",
        [
            "modules.vision.parallel.sp=4",
            "modules.vision.parallel.dp=2",
            "model=qwen_vl_7b",
            "modules.llm.parallel.tp=4",
            "modules.llm.parallel.dp=2",
        ],
    )
    assert cfg.modules.vision.parallel.sp == 4 and cfg.model.name == "qwen_vl_7b"


def _axes(cfg) -> dict[str, set[str]]:
    return {str(n): {a for a in PARALLEL_AXES if m.parallel[a] > 1} for n, m in cfg.modules.items()}


@pytest.mark.parametrize("recipe", RECIPES)
def test_smoke_keeps_strategies_and_fits_four_ranks(recipe: str) -> None:
    full = _full(recipe)
    smoke = _smoke(recipe)  # validates
    assert smoke.cluster.name == "local_cpu" and smoke.cluster.device == "cpu"
    tiny = smoke.model.name
    assert (
        tiny == "tiny" or tiny.startswith(f"tiny_{full.model.family}")
    ) and smoke.model.family == full.model.family
    assert smoke.train.steps == 2
    for name, axes in _axes(smoke).items():
        full_axes = _axes(full)[name]
        assert axes - {"dp"} == full_axes - {"dp"}, (name, axes, full_axes)  # SP stays SP, TP stays TP...
        mod = smoke.modules[name]
        assert all(mod.parallel[a] in (1, 2) for a in PARALLEL_AXES)
        assert mod.gpus == module_layout(mod).world_size  # dp x fsdp x cp x sp x tp
    plan = compile_plan(smoke)
    assert {d.global_gpu for d in plan.devices} <= set(range(4))
    assert plan.fits


def test_smoke_is_pure() -> None:
    cfg = compose_config("qwen_vl_32b", [])
    before = OmegaConf.to_yaml(cfg)
    smoke_config(
        cfg,
        tiny_model=OmegaConf.load(CONF_DIR / "model" / "tiny.yaml"),
        local_cluster=OmegaConf.load(CONF_DIR / "cluster" / "local_cpu.yaml"),
        consumer=known_consumer(cfg.model.family),
    )
    assert OmegaConf.to_yaml(cfg) == before


def test_smoke_drops_dp_first_when_too_wide() -> None:
    cfg = load_config("qwen_vl_72b", ["placement=disaggregated", "cluster.nodes=4"], smoke=True)
    # vision dp2 x sp2 (4) + llm fsdp2 x tp2 (4) = 8 ranks > 4: dp goes first, then fsdp
    vision, llm = cfg.modules.vision.parallel, cfg.modules.llm.parallel
    assert (vision.dp, vision.sp, llm.fsdp, llm.tp) == (1, 2, 1, 2)
    assert cfg.modules.vision.gpus + cfg.modules.llm.gpus == 4


def test_smoke_keeps_collocated_groups_on_one_gpu_set() -> None:
    """vision sp8 beside llm fsdp4 x tp2 shrinks to sp2 (2 ranks) beside fsdp2 x tp2 (4): the encoder
    gets dp2 so both collocated groups share the 4 ranks, and the shrunk plan validates."""
    over = ["modules.vision.parallel.sp=8", "modules.vision.parallel.fsdp=1", "modules.vision.parallel.zero=1",
            "modules.llm.parallel.fsdp=4", "modules.llm.parallel.tp=2", "placement=collocated"]  # fmt: skip
    cfg = load_config("qwen_vl_32b", over, smoke=True)
    v, lm = cfg.modules.vision, cfg.modules.llm
    assert (v.gpus, v.parallel.dp, v.parallel.sp, v.parallel.zero) == (4, 2, 2, 1)
    assert (lm.gpus, lm.parallel.fsdp, lm.parallel.tp) == (4, 2, 2)


def test_smoke_shrinks_a_flavour_to_its_own_tiny_model() -> None:
    """A recipe shrinks to the tiny model of its family that declares the same ``extra`` keys: the
    Qwen3.5-MoE recipe to tiny_qwen3_5_moe (none of its 256 experts of 512 left behind by the merge),
    the dense Qwen3.5 recipe to tiny_qwen3_5, a family with one tiny entry to that one."""
    moe = _smoke("qwen3_5_35b_a3b").model
    tiny_moe = OmegaConf.load(CONF_DIR / "model" / "tiny_qwen3_5_moe.yaml")
    assert moe.name == "tiny_qwen3_5_moe" and moe.llm.extra == tiny_moe.llm.extra
    assert moe.llm.intermediate_size == tiny_moe.llm.intermediate_size
    dense = _smoke("qwen3_5_27b").model
    assert dense.name == "tiny_qwen3_5" and "num_experts" not in dense.llm.extra
    assert _smoke("qwen3_vl_30b_a3b").model.name == "tiny_qwen3_vl_moe"


def test_the_sft_presets_make_any_recipe_the_sft_recipes_fine_tune() -> None:
    """`conf=qwen_vl_7b train=sft data=sft` (the presets on a base recipe) trains and holds out its
    data as the SFT recipe does; +lora=attn_mlp adds the same LoRA as the recipe's lora=attn_mlp."""
    preset = load_config("qwen_vl_7b", ["train=sft", "data=sft", "+lora=attn_mlp"], smoke=True)
    recipe = load_config("sft_qwen_vl_7b", ["lora=attn_mlp"], smoke=True)
    assert preset.train == recipe.train and preset.data == recipe.data
    assert preset.modules.llm.lora == recipe.modules.llm.lora and recipe.modules.llm.lora.rank > 0
    assert recipe.train.eval_every == 1 and recipe.data.eval.split > 0  # smoke: an eval each step
