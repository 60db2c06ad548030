"""`freeze: true` on the vision module: no backward there, no optimizer state, weights unchanged;
the LLM still trains (on a real local Ray, gloo, tiny Qwen2.5-VL, every degree 1)."""

from __future__ import annotations

import pytest
import torch
from plans import ALL_ONE

from dhp.data import build_run_loader
from dhp.plan import compile_plan
from dhp.plan.compile import module_layouts
from dhp.runtime import Trainer
from dhp.validation import load_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_frozen_encoder_gets_no_grads_no_optimizer_state_and_stays_put(ray_local):
    cfg = load_config(
        "tiny_vlm",
        [
            *ALL_ONE,
            "modules.vision.freeze=true",
        ],
    )
    trainer = Trainer(cfg, compile_plan(cfg))
    try:
        loader = build_run_loader(cfg, module_layouts(cfg))
        before = trainer.full_state_dict()
        res = trainer.step(next(loader), lr=1e-3, collect_grads=True)
        res = trainer.step(next(loader), lr=1e-3, collect_grads=True)
        after = trainer.full_state_dict()
    finally:
        trainer.close()
    assert res.grads["vision"] == {} and len(res.grads["llm"]) > 0
    assert res.stats["vision"][0]["optim_state_bytes"] == 0 and res.stats["llm"][0]["optim_state_bytes"] > 0
    assert res.stats["vision"][0]["bwd_s"] == 0.0  # no encoder backward at all
    assert all(torch.equal(before["vision"][k], after["vision"][k]) for k in before["vision"])
    assert any(not torch.equal(before["llm"][k], after["llm"][k]) for k in before["llm"])
