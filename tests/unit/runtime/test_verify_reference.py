"""The reference side of ``dhp verify`` (no Ray): loss normalisation, grads, clip, frozen modules, diffs."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from dhp.data import build_run_loader
from dhp.data.batch import concat_batches
from dhp.errors import ConfigError
from dhp.models import get_family
from dhp.plan.compile import module_layouts
from dhp.runtime.verify.compare import (
    ReferenceModel,
    StepDiff,
    VerifyReport,
    check_verifiable,
    compare_grads,
    definition_differs,
    step_batch,
)
from dhp.validation import load_config

pytestmark = pytest.mark.unit


def _setup(overrides: list[str]):
    cfg = OmegaConf.to_object(load_config("tiny_vlm", overrides))
    loader = build_run_loader(cfg, module_layouts(cfg))
    family = get_family(cfg.model.family)
    hf = family.hf_config(cfg.model)
    torch.manual_seed(0)
    init = {
        n: {
            k: v.clone()
            for k, v in family.build_module(n, hf, device="cpu", dtype=torch.float32).state_dict().items()
        }
        for n in family.module_names
    }
    return cfg, loader, init


def test_reference_loss_is_hf_mean_loss_and_grads_cover_every_param() -> None:
    cfg, loader, init = _setup(["train.global_batch_size=2", "train.micro_batch_size=2", "train.grad_clip=0"])
    data = next(loader)
    assert len(data.micro_batches) == 1 and len(data.micro_batches[0]) == 1
    ref = ReferenceModel(model=cfg.model, modules=cfg.modules, train=cfg.train, initial=init)
    b = data.micro_batches[0][0]
    with torch.no_grad():  # HF's own mean loss on the same weights, before the step
        hf_loss = ref.model(
            input_ids=b.input_ids,
            attention_mask=b.attention_mask,
            pixel_values=b.pixel_values,
            image_grid_thw=b.image_grid_thw,
            mm_token_type_ids=b.mm_token_type_ids,
            labels=b.labels,
        ).loss
    loss, norm, grads = ref.step(data, lr=1e-3)
    assert loss == pytest.approx(float(hf_loss), rel=1e-6)  # fp32 sum/T vs HF mean: same tokens
    assert set(grads) == {"vision", "llm"}
    assert set(grads["vision"]) == {k for k in init["vision"]}
    assert set(grads["llm"]) == {k for k in init["llm"]}
    direct = math.sqrt(sum(float(g.double().pow(2).sum()) for m in grads.values() for g in m.values()))
    assert norm == pytest.approx(direct, rel=1e-9)


def test_frozen_vision_gets_no_grads_and_no_optimizer_state() -> None:
    cfg, loader, init = _setup(["modules.vision.freeze=true"])
    ref = ReferenceModel(model=cfg.model, modules=cfg.modules, train=cfg.train, initial=init)
    before = {k: v.clone() for k, v in ref.model.state_dict().items()}
    _, _, grads = ref.step(next(loader), lr=1e-3)
    assert set(grads) == {"llm"}
    after = ref.model.state_dict()
    visual = [k for k in before if ".visual." in k or k.startswith("visual.")]
    assert visual and all(torch.equal(before[k], after[k]) for k in visual)
    assert any(not torch.equal(before[k], after[k]) for k in before if k not in visual)


def test_reference_starts_from_the_given_weights() -> None:
    cfg, _, init = _setup([])
    ref = ReferenceModel(model=cfg.model, modules=cfg.modules, train=cfg.train, initial=init)
    split = get_family("qwen2_5_vl").split_state_dict(ref.model.state_dict())
    for module, sd in init.items():
        assert all(torch.equal(sd[k], split[module][k]) for k in sd)


def test_compare_grads_missing_or_misshaped_is_infinite() -> None:
    a = {"llm": {"w": torch.zeros(2), "v": torch.ones(3)}}
    b = {"llm": {"w": torch.full((2,), 0.5), "v": torch.ones(3)}}
    diffs, worst = compare_grads(a, b)
    assert diffs == {"llm": 0.5} and worst == {"llm": "w"}
    # a gradient one side never made is compared with zero: a nonzero one on the other side fails
    diffs, worst = compare_grads(a, {"llm": {"w": torch.zeros(2)}})
    assert diffs["llm"] == 1.0 and worst["llm"] == "v"
    diffs, worst = compare_grads(
        {"llm": {"w": torch.zeros(2), "u": torch.zeros(4)}}, {"llm": {"w": torch.zeros(2)}}
    )
    assert diffs["llm"] == 0.0
    diffs, _ = compare_grads(a, {"llm": {"w": torch.zeros(3), "v": torch.ones(3)}, "vision": {}})
    assert diffs["llm"] == math.inf and "vision" in diffs


def test_report_tolerances() -> None:
    ok = StepDiff(1, 2.0, 2.0 * (1 + 5e-6), 1.0, 1.0, {"llm": 5e-5}, {"llm": "w"})
    bad_loss = StepDiff(2, 2.0, 2.0 * (1 + 5e-5), 1.0, 1.0, {"llm": 0.0}, {"llm": "w"})
    bad_grad = StepDiff(3, 2.0, 2.0, 1.0, 1.0, {"llm": 2e-4}, {"llm": "w"})
    assert VerifyReport(steps=[ok]).passed
    assert not VerifyReport(steps=[ok, bad_loss]).passed
    assert not VerifyReport(steps=[bad_grad]).passed
    assert not VerifyReport(steps=[]).passed  # nothing compared proves nothing


def test_verify_refuses_bf16() -> None:
    cfg = load_config("tiny_vlm", ["model.dtype=bfloat16", "modules.llm.mixed_precision=bf16"])
    with pytest.raises(ConfigError) as e:
        check_verifiable(cfg)
    assert "model.dtype" in str(e.value) and "modules.llm.mixed_precision" in str(e.value)


def test_report_holds_grad_norm_and_parameters_after_the_update() -> None:
    ok = StepDiff(1, 2.0, 2.0, 1.0, 1.0 + 5e-6, {"llm": 0.0}, {"llm": "w"}, {"llm": 5e-5}, {"llm": "w"})
    bad_norm = StepDiff(2, 2.0, 2.0, 1.0, 1.0 + 5e-5, {"llm": 0.0}, {"llm": "w"}, {"llm": 0.0}, {"llm": "w"})
    bad_param = StepDiff(3, 2.0, 2.0, 1.0, 1.0, {"llm": 0.0}, {"llm": "w"}, {"llm": 2e-4}, {"llm": "w"})
    missing = StepDiff(4, 2.0, 2.0, 1.0, 1.0, {"llm": 0.0}, {"llm": "w"}, {"llm": math.inf}, {"llm": "v"})
    assert VerifyReport(steps=[ok]).passed
    assert not VerifyReport(steps=[bad_norm]).passed
    assert not VerifyReport(steps=[bad_param]).passed
    assert not VerifyReport(steps=[missing]).passed  # a parameter on one side only


def test_reference_params_match_the_plan_keys_and_move_with_the_step() -> None:
    cfg, loader, init = _setup([])
    ref = ReferenceModel(model=cfg.model, modules=cfg.modules, train=cfg.train, initial=init)
    before = ref.params()
    assert {m: set(v) for m, v in before.items()} == {m: set(v) for m, v in init.items()}
    diffs, _ = compare_grads(before, init)
    assert diffs == {"vision": 0.0, "llm": 0.0}
    before = {m: {k: v.clone() for k, v in sd.items()} for m, sd in before.items()}
    ref.step(next(loader), lr=1e-3)
    diffs, _ = compare_grads(ref.params(), before)
    assert all(d > 0 for d in diffs.values())  # the update moved both modules


def test_reference_update_applies_the_given_grads_and_returns_its_own() -> None:
    # dhp verify steps the reference with the plan's grads: an update from given grads equals an
    # update from the reference's own grads scaled the same way, and the returned grads stay its own
    cfg, loader, init = _setup(["train.grad_clip=0", "train.weight_decay=0"])
    data = next(loader)
    own = ReferenceModel(model=cfg.model, modules=cfg.modules, train=cfg.train, initial=init)
    forced = ReferenceModel(model=cfg.model, modules=cfg.modules, train=cfg.train, initial=init)
    _, own_norm, own_grads = own.step(data, lr=1e-3)
    flipped = {m: {k: -g for k, g in sd.items()} for m, sd in own_grads.items()}
    _, norm, grads = forced.step(data, lr=1e-3, apply_grads=flipped)
    assert norm == own_norm  # the reported norm and grads are the reference's own computation
    assert compare_grads(grads, own_grads)[0] == {"vision": 0.0, "llm": 0.0}
    # AdamW's first step is lr * sign(g): the flipped grads move every trained element the other way
    for m, sd in forced.params().items():
        for k, p in sd.items():
            moved_own, moved_forced = own.params()[m][k] - init[m][k], p - init[m][k]
            assert torch.allclose(moved_forced, -moved_own, atol=1e-6), (m, k)  # fp32 rounding of p - p0


def test_moe_reference_is_hf_on_the_whole_step_in_one_call() -> None:
    # 2 replicas x 2 micro-batches of 1 sample: the reference is ONE forward of transformers' model on
    # the step's 4 samples with output_router_logits (its own loss: mean CE + coef * aux over all 4)
    cfg = OmegaConf.to_object(load_config("tiny_qwen3_vl_moe", ["train.micro_batch_size=1"]))
    data = next(build_run_loader(cfg, module_layouts(cfg)))
    assert len(data.micro_batches) == 2 and len(data.micro_batches[0]) == 2
    family = get_family(cfg.model.family)
    hf = family.hf_config(cfg.model)
    torch.manual_seed(0)
    init = {
        n: dict(family.build_module(n, hf, device="cpu", dtype=torch.float32).state_dict())
        for n in family.module_names
    }
    ref = ReferenceModel(model=cfg.model, modules=cfg.modules, train=cfg.train, initial=init)
    assert ref.definition(data) == (
        "Qwen3VLMoeForConditionalGeneration on the step's 4 samples in one call; loss = mean CE + "
        "0.02 * load_balancing_loss_func (transformers' own)"
    )
    whole = step_batch(data, pad_token_id=cfg.model.tokens.pad_token_id)
    assert whole.input_ids.shape[0] == 4 and whole.num_label_tokens == data.num_label_tokens
    with torch.no_grad():
        out = ref.model(
            input_ids=whole.input_ids,
            attention_mask=whole.attention_mask,
            labels=whole.labels,
            mm_token_type_ids=whole.mm_token_type_ids,
            pixel_values=whole.pixel_values,
            image_grid_thw=whole.image_grid_thw,
            output_router_logits=True,
        )
    loss, _, grads = ref.step(data, lr=1e-3)
    assert loss == pytest.approx(float(out.loss), rel=1e-6) and float(out.aux_loss) > 0
    assert any(k.endswith("mlp.gate.weight") for k in grads["llm"])  # the routers get the aux gradient


def test_a_plan_defined_otherwise_fails_with_the_reason() -> None:
    cfg = load_config("tiny_qwen3_vl_moe", ["train.micro_batch_size=1", "train.router_aux_loss=micro_batch"])
    data = next(build_run_loader(cfg, module_layouts(cfg)))
    why = definition_differs(cfg, data, router_coef=0.02)
    assert "train.router_aux_loss=micro_batch with 2 micro-batches per LLM replica" in why
    assert definition_differs(cfg, data, router_coef=None) == ""  # a dense model has no router term
    ok = StepDiff(1, 2.0, 2.0, 1.0, 1.0, {"llm": 0.0}, {"llm": "w"})
    assert VerifyReport(steps=[ok]).passed and not VerifyReport(steps=[ok], definition_differs=why).passed


def test_concat_batches_pads_rows_and_keeps_the_image_order() -> None:
    cfg = OmegaConf.to_object(load_config("tiny_vlm", ["train.micro_batch_size=1"]))
    data = next(build_run_loader(cfg, module_layouts(cfg)))
    parts = [b for mb in data.micro_batches for b in mb]
    whole = concat_batches(parts, pad_token_id=0)
    assert whole.input_ids.shape == (len(parts), max(b.input_ids.shape[1] for b in parts))
    assert whole.num_label_tokens == data.num_label_tokens
    assert torch.equal(whole.pixel_values, torch.cat([b.pixel_values for b in parts]))
    for i, b in enumerate(parts):
        n = b.input_ids.shape[1]
        assert torch.equal(whole.input_ids[i, :n], b.input_ids[0]) and not whole.attention_mask[i, n:].any()
