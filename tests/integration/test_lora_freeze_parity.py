"""Partial freeze, per-group optimizer settings and LoRA through the real runtime (Ray actor groups,
gloo, tiny Qwen2.5-VL in fp32) against the single-process transformers model with the same settings
(``dhp.runtime.verify.compare.ReferenceModel``: the same frozen set, peft's LoRA layers, AdamW with the same
param groups, the same clip and LR).

Tolerances (fp32, those of dhp verify): loss within 1e-5 relative; every gradient and, after the last step,
every trainable parameter within 1e-4 absolute (SP/TP/ZeRO-1 sum in another order than one process:
gradients differ by ~1e-6). LRs are 1e-4 (default) and 1e-3 (the groups): AdamW's normalised step
turns a rounding-level difference of a near-zero gradient into up to ~lr per element, so parameters
agree to ~lr/10 at best; a group run at the wrong LR is off by ~1e-3 per element and fails.
"""

from __future__ import annotations

import pytest
import torch

from dhp.data import build_run_loader
from dhp.plan import compile_plan
from dhp.plan.compile import module_layouts
from dhp.runtime import Trainer
from dhp.runtime.loop.schedule import WarmupCosine
from dhp.runtime.verify.compare import ReferenceModel, compare_grads
from dhp.validation import load_config

pytestmark = [pytest.mark.integration]

LOSS_RTOL, ATOL = 1e-5, 1e-4
STEPS = 2


def _run(overrides: list[str]):
    """STEPS steps of the plan and of the reference; returns (per-step results, final states, ref)."""
    cfg = load_config("tiny_vlm", ["train.warmup_steps=0", "train.lr=1e-4", *overrides])
    t = cfg.train
    schedule = WarmupCosine(lr=t.lr, warmup_steps=0, total_steps=STEPS, min_lr_ratio=t.min_lr_ratio)
    loader = build_run_loader(cfg, module_layouts(cfg))
    trainer = Trainer(cfg, compile_plan(cfg))
    try:
        initial = trainer.full_state_dict()
        ref = ReferenceModel(model=cfg.model, modules=dict(cfg.modules), train=t, initial=initial)
        steps = []
        for _ in range(STEPS):
            data, lr = next(loader), schedule.next_lr()
            res = trainer.step(data, lr=lr, collect_grads=True)
            steps.append((res, ref.step(data, lr=lr)))
        final = trainer.full_state_dict()
    finally:
        trainer.close()
    return steps, initial, final, ref


def _check_steps(steps) -> None:
    for res, (ref_loss, _, ref_grads) in steps:
        assert abs(res.loss - ref_loss) <= LOSS_RTOL * abs(ref_loss), (res.loss, ref_loss)
        diffs, worst = compare_grads(res.grads, ref_grads)
        assert all(d <= ATOL for d in diffs.values()), (diffs, worst)


def _check_params(final, ref: ReferenceModel) -> dict[str, set[str]]:
    """Every trainable parameter of the plan equals the reference's; returns the trainable FQNs."""
    trainable: dict[str, set[str]] = {}
    for key, p in ref.model.named_parameters():
        module, fqn = ref.owner[key]
        if p.requires_grad:
            trainable.setdefault(module, set()).add(fqn)
            diff = float((final[module][fqn] - p.detach()).abs().max())
            assert diff <= ATOL, (module, fqn, diff)
    return trainable


@pytest.mark.slow  # 12 s of Ray groups; the fast tier holds LoRA's and the groups' pure rules
def test_lora_under_llm_tp2_sp_beside_freeze_and_param_groups_under_vision_sp2_zero1(ray_local):
    # one run (Ray actor groups are the expensive part): vision SP=2 with ZeRO-1 (sharded over sp), block 0
    # frozen, the merger at 10x LR; LLM TP=2 with sequence parallelism and LoRA on q/v (colwise: A
    # replicated, B colwise) and o/down (rowwise: A rowwise, B replicated), layer 0's adapters at 10x LR
    steps, initial, final, ref = _run(
        [
            "modules.vision.parallel.zero=1",
            "modules.vision.freeze_patterns=[visual.blocks.0]",
            "modules.vision.param_groups=[{match: visual.merger, lr: 1e-3}]",
            "modules.llm.lora.rank=4",
            "modules.llm.lora.alpha=8",
            "modules.llm.lora.targets=[language_model.layers.*.self_attn.q_proj,"
            "language_model.layers.*.self_attn.v_proj,language_model.layers.*.self_attn.o_proj,"
            "language_model.layers.*.mlp.down_proj]",
            "modules.llm.param_groups=[{match: language_model.layers.0, lr: 1e-3, weight_decay: 0.1}]",
        ]
    )
    _check_steps(steps)
    trainable = _check_params(final, ref)
    grads = steps[-1][0].grads
    # freeze: block 0 has no grad on either side and is bit-for-bit unchanged; the rest of vision trains
    frozen = {k for k in initial["vision"] if k.startswith("visual.blocks.0.")}
    assert frozen and not frozen & set(grads["vision"]) and not frozen & trainable["vision"]
    assert all(torch.equal(initial["vision"][k], final["vision"][k]) for k in frozen)
    assert set(grads["vision"]) == trainable["vision"] == set(initial["vision"]) - frozen
    # per-group LR: the 10x group moved ~10x further than the default group (Adam ~ lr * sign(g))
    moved = lambda m, k: float((final[m][k] - initial[m][k]).abs().mean())  # noqa: E731
    assert moved("vision", "visual.merger.mlp.0.weight") > 5 * moved(
        "vision", "visual.blocks.1.mlp.up_proj.weight"
    )
    # LoRA: only adapters train (grads = adapters, all of them); the base is unchanged; B left zero
    assert trainable["llm"] and all(".lora_A." in k or ".lora_B." in k for k in trainable["llm"])
    assert set(grads["llm"]) == trainable["llm"]
    assert all(torch.equal(initial["llm"][k], final["llm"][k]) for k in initial["llm"] if ".lora_" not in k)
    assert all(final["llm"][k].abs().max() > 0 for k in trainable["llm"] if ".lora_B." in k)
    assert type(
        ref.model.get_submodule("model.language_model.layers.0.self_attn.q_proj")
    ).__module__.startswith("peft.")
