"""The planner counts only the trainable set: grads and AdamW states follow freeze_patterns and LoRA
(the adapters alone), params stay; a glob that matches nothing is a ConfigError at plan time."""

from __future__ import annotations

import pytest
import torch

from dhp.errors import ConfigError
from dhp.models import get_family
from dhp.plan import compile_plan
from dhp.validation import load_config

pytestmark = [pytest.mark.unit]


def _states(overrides: list[str]) -> dict[str, tuple[int, int, int]]:
    plan = compile_plan(load_config("tiny_vlm", overrides), estimate=False)
    return {
        g.name: (g.ranks[0].memory.params, g.ranks[0].memory.grads, g.ranks[0].memory.optimizer)
        for g in plan.groups
    }


def test_freeze_patterns_and_lora_shrink_grads_and_optimizer_by_the_trainable_share():
    full = _states([])
    part = _states(["modules.vision.freeze_patterns=[visual.blocks.0,visual.blocks.1]",
                    "modules.llm.lora.rank=2", "modules.llm.lora.targets=[language_model.layers.*.self_attn.q_proj]"])  # fmt: skip
    cfg = load_config("tiny_vlm", [])
    family = get_family("qwen2_5_vl")
    vision = family.build_module("vision", family.hf_config(cfg.model), device="meta", dtype=torch.float32)
    sizes = {n: p.numel() for n, p in vision.named_parameters()}
    frozen = sum(v for n, v in sizes.items() if n.startswith(("visual.blocks.0.", "visual.blocks.1.")))
    share = 1 - frozen / sum(sizes.values())
    assert part["vision"][0] == full["vision"][0]  # frozen weights still live on the rank
    assert part["vision"][1] == pytest.approx(full["vision"][1] * share, abs=2)
    assert part["vision"][2] == pytest.approx(full["vision"][2] * share, abs=2)
    # LoRA rank 2 on the 2 q_proj (128 -> 128): 2 * (2*128 + 128*2) adapter elements train
    llm = family.build_module("llm", family.hf_config(cfg.model), device="meta", dtype=torch.float32)
    base = sum(p.numel() for p in llm.parameters())
    assert part["llm"][1] == pytest.approx(full["llm"][1] * 1024 / base, abs=2)
    assert 0 < part["llm"][2] < full["llm"][2] / 100


def test_bad_globs_and_values_are_config_errors_reported_at_once():
    with pytest.raises(ConfigError) as e:
        load_config("tiny_vlm", ["modules.vision.freeze_patterns=[visual.blockz.0]", "export.lora=fold",
                                 "modules.vision.param_groups=[{match: visual.merger, lr: 0},{match: visual.merger.mlp}]",
                                 "modules.llm.lora.rank=4", "modules.llm.lora.dropout=1.5", "modules.vision.lora.rank=2",
                                 "modules.vision.lora.targets=[visual.blocks.0.attn.qkv]", "modules.vision.lora.dropout=0.1",
                                 "modules.llm.lora.targets=[lm_head,language_model.layers.*.nope]"])  # fmt: skip
    paths = {i.path for i in e.value.issues}
    assert {
        "export.lora",
        "modules.vision.freeze_patterns[0]",  # matches nothing
        "modules.vision.param_groups[0].lr",  # 0 is not a learning rate
        "modules.vision.param_groups[1].match",  # overlaps group 0
        "modules.llm.lora.dropout",  # out of [0, 1) and, under TP, not supported
        "modules.llm.lora.targets[0]",  # lm_head: the loss reads its weight, an adapter would never run
        "modules.llm.lora.targets[1]",  # matches nothing
    } <= paths, paths
    assert "modules.vision.lora.dropout" not in paths  # dropout is fine without TP (vision runs SP)
