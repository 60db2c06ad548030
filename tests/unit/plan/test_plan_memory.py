"""Memory model: parameter counts against transformers' own model, sharding rules, and verdicts."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from dhp.config import load_config
from dhp.config.loader import CONF_DIR
from dhp.plan import compile_plan
from dhp.plan.memory import STATE_BYTES, estimate_module, module_shape
from dhp.plan.params import module_params

pytestmark = pytest.mark.unit
GIB = 1 << 30


def _hf_model_on_meta(model):
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    v, t = model.vision, model.llm
    hf = Qwen2_5_VLConfig(
        vision_config={
            "depth": v.depth,
            "hidden_size": v.hidden_size,
            "num_heads": v.num_heads,
            "intermediate_size": v.intermediate_size,
            "patch_size": v.patch_size,
            "spatial_merge_size": v.spatial_merge_size,
            "temporal_patch_size": v.temporal_patch_size,
            "window_size": v.window_size,
            "in_channels": v.in_channels,
            "fullatt_block_indexes": list(v.fullatt_block_indexes),
            "out_hidden_size": t.hidden_size,
        },
        text_config={
            "hidden_size": t.hidden_size,
            "num_hidden_layers": t.num_layers,
            "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads,
            "intermediate_size": t.intermediate_size,
            "vocab_size": t.vocab_size,
            "tie_word_embeddings": t.tie_word_embeddings,
        },
        tie_word_embeddings=t.tie_word_embeddings,
    )
    with torch.device("meta"):
        return Qwen2_5_VLForConditionalGeneration(hf)


@pytest.mark.parametrize("name", ["tiny", "qwen_vl_3b", "qwen_vl_7b"])
def test_param_counts_match_transformers(name: str) -> None:
    model = OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")
    hf = _hf_model_on_meta(model)
    # exact: the formulas in dhp/plan/params.py must count every parameter of the real modules
    visual = sum(p.numel() for p in hf.model.visual.parameters())
    llm = sum(p.numel() for n, p in hf.named_parameters() if not n.startswith("model.visual."))
    assert module_params("vision", model).total == visual
    assert module_params("llm", model).total == llm


def _estimate(recipe: str, overrides: list[str], name: str):
    cfg = load_config(recipe, overrides)
    shape = module_shape(
        name, model=cfg.model, module=cfg.modules[name], micro_batch=cfg.train.micro_batch_size
    )
    return estimate_module(shape, model=cfg.model), shape


def test_tp_shards_model_states_sp_shards_activations() -> None:
    sp8, _ = _estimate(
        "qwen_vl_32b_tp", ["modules.vision.parallel.tp=1", "modules.vision.parallel.sp=8"], "vision"
    )
    tp8, _ = _estimate("qwen_vl_32b_tp", [], "vision")
    assert tp8.params < sp8.params / 3  # TP splits the projections; SP replicates them
    assert sp8.activations < tp8.activations  # SP cuts every activation by 8; TP leaves norms whole
    sp4, _ = _estimate(
        "qwen_vl_32b_tp",
        [
            "modules.vision.parallel.tp=1",
            "modules.vision.parallel.sp=4",
            "modules.vision.gpus=4",
            "modules.llm.gpus=4",
            "modules.llm.parallel.tp=4",
        ],
        "vision",
    )
    assert sp4.params == sp8.params
    assert sp4.detail["layers"] == pytest.approx(2 * sp8.detail["layers"], rel=1e-6)


def test_zero1_shards_optimizer_over_dp_and_sp() -> None:
    z0, _ = _estimate("qwen_vl_32b", ["modules.vision.parallel.zero=0"], "vision")
    z1, _ = _estimate("qwen_vl_32b", [], "vision")
    assert z1.optimizer == pytest.approx(z0.optimizer / 8, rel=1e-6)
    assert (z1.params, z1.grads, z1.activations) == (z0.params, z0.grads, z0.activations)


def test_fsdp_shards_all_states_but_not_activations() -> None:
    fsdp, _ = _estimate("qwen_vl_32b_zero3", [], "llm")
    plain, _ = _estimate(
        "qwen_vl_32b_zero3", ["modules.llm.parallel.fsdp=1", "modules.llm.parallel.dp=8"], "llm"
    )
    assert fsdp.optimizer == pytest.approx(plain.optimizer / 8, rel=1e-6)
    assert fsdp.grads == pytest.approx(plain.grads / 8, rel=1e-6)
    assert plain.params / 8 < fsdp.params < plain.params / 4  # shard + 2 gathered layers in flight
    assert fsdp.activations == plain.activations


def test_dtype_policies_bytes_per_param() -> None:
    assert STATE_BYTES == {"bf16_master_fp32": (2, 2, 12), "bf16": (2, 2, 4), "fp32": (4, 4, 8)}
    mixed, shape = _estimate("qwen_vl_7b", ["modules.llm.parallel.zero=0"], "llm")
    pure, _ = _estimate(
        "qwen_vl_7b", ["modules.llm.parallel.zero=0", "modules.llm.mixed_precision=bf16"], "llm"
    )
    p_rank = shape.params.per_tp_rank(4)
    assert mixed.params == int(2 * p_rank) and mixed.optimizer == int(12 * p_rank)
    assert pure.optimizer == int(4 * p_rank)


def test_activation_checkpointing_and_attention_kernel() -> None:
    ac, _ = _estimate("qwen_vl_32b", [], "llm")
    no_ac, _ = _estimate("qwen_vl_32b", ["modules.llm.activation_checkpointing=false"], "llm")
    assert ac.detail["layers"] < no_ac.detail["layers"] / 5
    eager, _ = _estimate("qwen_vl_32b", ["model.attn_implementation=eager"], "llm")
    assert eager.detail["attention_scores"] > 0 == ac.detail["attention_scores"]
    longer, _ = _estimate(
        "qwen_vl_32b",
        ["model.attn_implementation=eager", "modules.llm.seq_len=9216", "data.synthetic.text_tokens=5112"],
        "llm",
    )
    assert longer.detail["attention_scores"] == pytest.approx(4 * eager.detail["attention_scores"], rel=1e-6)


def test_logits_are_vocab_parallel() -> None:
    tp8, _ = _estimate("qwen_vl_32b", [], "llm")
    tp1, _ = _estimate(
        "qwen_vl_7b",
        [
            "modules.llm.parallel.tp=1",
            "modules.llm.parallel.dp=8",
            "modules.llm.parallel.zero=0",
            "model=qwen_vl_32b",
        ],
        "llm",
    )
    assert tp1.detail["logits_loss"] == pytest.approx(8 * tp8.detail["logits_loss"], rel=1e-6)
    # 4608 tokens x 152064 vocab x (2 bf16 logits + 4 fp32 log-softmax + 4 fp32 grad)
    assert tp1.detail["logits_loss"] == 4608 * 152064 * 10


def test_headline_fits_and_zero3_ooms_on_vision_activations() -> None:
    sp_tp = compile_plan(load_config("qwen_vl_32b", []))
    assert sp_tp.fits and sp_tp.min_margin > 1 * GIB
    zero3 = compile_plan(load_config("qwen_vl_32b_zero3", []))
    assert not zero3.fits
    vision = zero3.group("vision").ranks[0].memory
    assert vision.activations > 10 * (vision.params + vision.grads + vision.optimizer)
    # ZeRO-3 at 16K patches holds every patch's activations on every rank; SP=8 holds 1/8 of them
    assert vision.activations > 6 * sp_tp.group("vision").ranks[0].memory.activations


def test_sp_trains_longer_images_than_zero3() -> None:
    def fits(recipe: str, patches: int) -> bool:
        ov = [
            f"modules.vision.seq_len={patches}",
            f"data.synthetic.patches={patches // 4}",
            f"modules.llm.seq_len={patches // 4 + 512}",
        ]
        return compile_plan(load_config(recipe, ov)).fits

    assert fits("qwen_vl_32b", 16384) and not fits("qwen_vl_32b_zero3", 16384)
    assert fits("qwen_vl_32b_zero3", 2048)  # ZeRO-3 only trains short images


def test_collocated_totals_add_up_per_gpu() -> None:
    plan = compile_plan(load_config("qwen_vl_32b", []))
    want = sum(g.ranks[0].memory.total for g in plan.groups)
    assert all(d.total == want for d in plan.devices)
    assert plan.devices[0].budget == plan.device_memory_bytes - plan.reserve_bytes


def test_frozen_encoder_keeps_no_grads_or_activations_frozen_llm_still_backprops() -> None:
    train, _ = _estimate("qwen_vl_32b", [], "vision")
    frozen, _ = _estimate("qwen_vl_32b", ["modules.vision.freeze=true"], "vision")
    assert (frozen.grads, frozen.optimizer) == (0, 0) and frozen.params == train.params
    assert frozen.detail["layers"] * 8 < train.detail["layers"]  # one block's working set, not 32
    llm_frozen, _ = _estimate("qwen_vl_32b", ["modules.llm.freeze=true"], "llm")
    llm_train, _ = _estimate("qwen_vl_32b", [], "llm")
    assert llm_frozen.optimizer == 0 and llm_frozen.activations == llm_train.activations
