"""Pure parts of LoRA / freeze / param groups: FQN globs, the optimizer's groups and their LR scaling,
and how a TP plan is rewritten for peft-wrapped layers (which adapter gets which style)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from dhp.config.schema import LoraConfig, ModuleConfig, ParamGroupConfig, TrainConfig
from dhp.errors import ConfigError
from dhp.models import get_family
from dhp.models.qwen2_5_vl.parallel import llm_tp_plan, vision_tp_plan
from dhp.parallel.lora import ReplicateParallel, apply_lora, lora_tp_plan
from dhp.parallel.param_groups import apply_trainable, glob_matches, optimizer_groups, set_lr
from dhp.parallel.vision_tp import FusedColwiseParallel

pytestmark = [pytest.mark.unit]


def _module(name: str, lora: LoraConfig | None = None) -> torch.nn.Module:
    family = get_family("qwen2_5_vl")
    hf = family.hf_config(family.tiny_model_config())
    m = family.build_module(name, hf, device="meta", dtype=torch.float32)
    return m if lora is None else apply_lora(m, module_name=name, lora=OmegaConf.structured(lora))


def test_globs_match_atoms_and_submodule_prefixes():
    assert glob_matches("visual.blocks.12.attn.qkv.weight", "visual.blocks.1[0-9]")
    assert glob_matches("visual.merger.mlp.0.bias", "visual.merger")
    assert not glob_matches("visual.blocks.2.attn.qkv.weight", "visual.blocks.1[0-9]")
    assert not glob_matches("visual.blocks", "visual.blocks.*")  # a glob longer than the FQN
    assert glob_matches("language_model.layers.3.mlp.up_proj.weight", "*.*.*.mlp")


def test_optimizer_groups_follow_the_config_and_the_schedule_scales_each():
    m = _module("vision")
    cfg = OmegaConf.structured(
        ModuleConfig(
            freeze_patterns=["visual.blocks.0"],
            param_groups=[ParamGroupConfig(match="visual.merger", lr=1e-2)],
        )
    )
    train = OmegaConf.structured(TrainConfig(lr=1e-3, weight_decay=0.05))
    apply_trainable(m, module_name="vision", module_cfg=cfg, lr=train.lr)
    groups = optimizer_groups(m, param_groups=cfg.param_groups, train=train)
    names = {id(p): n for n, p in m.named_parameters()}
    assert [g["name"] for g in groups] == ["default", "visual.merger"]
    assert all(names[id(p)].startswith("visual.merger.") for p in groups[1]["params"])
    assert not any(names[id(p)].startswith("visual.blocks.0.") for g in groups for p in g["params"])
    assert (groups[0]["weight_decay"], groups[1]["weight_decay"]) == (0.05, 0.05)
    opt = torch.optim.AdamW([{**g, "params": []} for g in groups])  # meta params: groups only
    set_lr(opt, 5e-4)  # the schedule's LR at some step: every group scaled alike
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4, 5e-3])


def test_tp_plan_for_lora_layers_follows_the_base_style():
    lora = LoraConfig(
        rank=2,
        targets=["language_model.layers.*.self_attn.q_proj", "language_model.layers.*.self_attn.o_proj"],
    )
    plan = lora_tp_plan(_module("llm", lora), llm_tp_plan(sequence_parallel=True))
    q, o = "language_model.layers.0.self_attn.q_proj", "language_model.layers.0.self_attn.o_proj"
    assert isinstance(plan[f"{q}.base_layer"], ColwiseParallel) and isinstance(
        plan[f"{q}.lora_B.default"], ColwiseParallel
    )
    assert f"{q}.lora_A.default" not in plan  # colwise base: A replicated
    a = plan[f"{o}.lora_A.default"]
    assert isinstance(a, RowwiseParallel) and a.output_layouts == (
        Shard(1),
    )  # reduce-scatter into sequence shards
    assert isinstance(plan[f"{o}.lora_B.default"], ReplicateParallel)  # B meets a Shard(1) DTensor
    assert "language_model.layers.*.mlp.gate_proj" in plan  # untouched entries keep their glob
    no_sp = lora_tp_plan(_module("llm", lora), llm_tp_plan(sequence_parallel=False))
    assert f"{o}.lora_B.default" not in no_sp  # replicated local output: B a plain replicated parameter
    vis = lora_tp_plan(
        _module("vision", LoraConfig(rank=2, targets=["visual.blocks.*.attn.qkv"])), vision_tp_plan()
    )
    assert isinstance(
        vis["visual.blocks.1.attn.qkv.lora_B.default"], FusedColwiseParallel
    )  # q|k|v rows move alike


def test_lora_on_a_vocab_parallel_embedding_is_refused_with_the_fix():
    m = _module("llm", LoraConfig(rank=2, targets=["language_model.layers.0.self_attn.q_proj"]))
    plan = {"language_model.layers.0.self_attn.q_proj": llm_tp_plan()["language_model.embed_tokens"]}
    with pytest.raises(ConfigError, match="no LoRA sharding rule"):
        lora_tp_plan(m, plan)


def test_planner_adapter_counts_equal_peft_layers():
    # the planner/validator count adapters from the target shapes (no peft build); peft must agree
    from dhp.parallel.lora import named_sizes_with_lora

    lora = OmegaConf.structured(
        LoraConfig(rank=3, targets=["visual.blocks.*.attn.qkv", "visual.patch_embed.proj"])
    )
    fast = named_sizes_with_lora(_module("vision"), module_name="vision", lora=lora)
    real = {
        n: p.numel()
        for n, p in apply_lora(_module("vision"), module_name="vision", lora=lora).named_parameters()
    }
    assert fast == real


def test_logged_group_lrs_are_the_optimizers():
    """metrics.jsonl's ``lr_groups`` names each optimizer group's LR as the workers' optimizer has it."""
    from dhp.metrics.record import group_lrs

    m = _module("vision")
    cfg = OmegaConf.structured(
        ModuleConfig(param_groups=[ParamGroupConfig(match="visual.merger", lr=1e-2, weight_decay=0.0)])
    )
    train = OmegaConf.structured(TrainConfig(lr=1e-3))
    groups = optimizer_groups(m, param_groups=cfg.param_groups, train=train)
    opt = torch.optim.AdamW([{**g, "params": []} for g in groups])
    set_lr(opt, 2.5e-4)  # mid-warmup: the schedule's LR, not train.lr
    frozen = OmegaConf.structured(ModuleConfig(freeze=True))
    logged = group_lrs({"vision": cfg, "llm": frozen}, lr=2.5e-4, base_lr=train.lr)
    assert logged == pytest.approx({f"vision/{g['name']}": g["lr"] for g in opt.param_groups})
    assert logged["vision/visual.merger"] == pytest.approx(2.5e-3)  # 10x the base group, as configured
