"""Qwen3-VL family: published numbers, arch validation, planner counts vs the real modules, key maps."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import dhp.models.qwen3_vl  # noqa: F401  (registers the family)
from dhp.errors import CheckpointError, ConfigError
from dhp.models import get_family
from dhp.models.qwen3_vl.arch import TINY_ARCH, TINY_LLM, TINY_VISION, arch_issues

pytestmark = pytest.mark.unit
CONF = Path(__file__).resolve().parents[3] / "conf" / "model"

# The released config.json numbers (see the YAML headers):
# (text hidden, layers, heads, kv heads, head_dim, intermediate, vocab, out_hidden, deepstack indexes)
PUBLISHED = {
    "qwen3_vl_8b": (4096, 36, 32, 8, 128, 12288, 151936, 4096, [8, 16, 24]),
    "qwen3_vl_32b": (5120, 64, 64, 8, 128, 25600, 151936, 5120, [8, 16, 24]),
}


@pytest.fixture(scope="module")
def family():
    return get_family("qwen3_vl")


def _yaml(name: str):
    return OmegaConf.load(CONF / f"{name}.yaml")


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_qwen3_vl_published_numbers(family, name):
    cfg = family.hf_config(_yaml(name))
    t, v = cfg.text_config, cfg.vision_config
    got = (
        t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
        t.intermediate_size, t.vocab_size, v.out_hidden_size, list(v.deepstack_visual_indexes),
    )  # fmt: skip
    assert got == PUBLISHED[name]
    vision = (
        v.depth,
        v.hidden_size,
        v.num_heads,
        v.intermediate_size,
        v.patch_size,
        v.num_position_embeddings,
    )
    assert vision == (27, 1152, 16, 4304, 16, 2304)
    assert t.rope_parameters["mrope_section"] == [24, 20, 20] and t.rope_parameters["rope_theta"] == 5e6
    assert t.max_position_embeddings == 262144 and v.hidden_act == "gelu_pytorch_tanh"
    assert not cfg.tie_word_embeddings and cfg.image_token_id == 151655


def test_qwen3_vl_tiny_yaml_is_the_tiny_config(family):
    from_yaml = family.hf_config(_yaml("tiny_qwen3_vl")).to_dict()
    assert from_yaml == family.tiny_hf_config().to_dict()


def _meta_counts(family, cfg, name):
    module = family.build_module(name, cfg, device="meta", dtype=torch.bfloat16)
    total = sum(p.numel() for p in module.parameters())
    block = module.visual.blocks[0] if name == "vision" else module.language_model.layers[0]
    largest = max(p.numel() for p in module.parameters())
    return total, sum(p.numel() for p in block.parameters()), largest


@pytest.mark.parametrize("which", ["tiny", "tiny_tied", "qwen3_vl_8b"])
def test_qwen3_vl_planner_counts_match_the_modules(family, which):
    if which.startswith("tiny"):
        cfg = family.tiny_hf_config(tie_word_embeddings=which == "tiny_tied")
        model_cfg = None
    else:
        model_cfg = _yaml(which)
        model_cfg.attn_implementation = "sdpa"  # the YAML's flash_attention_2 is not installed on CPU
        cfg = family.hf_config(model_cfg)
    from dhp.models.qwen3_vl.counts import block_counts, largest_param, module_counts

    for name in family.module_names:
        total, block, largest = _meta_counts(family, cfg, name)
        assert module_counts(name, cfg).total == total, name
        assert block_counts(name, cfg).total == block, name
        assert largest_param(name, cfg) == largest, name
        if model_cfg is not None:  # the planner's entry points read the schema's numbers
            assert family.module_params(name, model_cfg).total == total
            assert family.layer_params(name, model_cfg).total == block
            assert family.largest_param(name, model_cfg) == largest


def test_qwen3_vl_32b_geometry_has_the_real_attention_width(family):
    shape = family.layer_shape("llm", _yaml("qwen3_vl_32b"))
    assert (shape.hidden, shape.q_dim, shape.kv_dim, shape.head_dim) == (5120, 8192, 1024, 128)


def test_qwen3_vl_bad_arch_numbers_are_config_errors(family):
    vision = {**TINY_VISION, "fullatt_block_indexes": [0, 2]}
    llm = {**TINY_LLM, "mrope_section": [4, 4, 4]}
    arch = {
        "vision": {**TINY_ARCH["vision"], "deepstack_visual_indexes": [0, 3], "num_position_embeddings": 15},
        "llm": dict(TINY_ARCH["llm"]),
    }
    paths = {i.path for i in arch_issues(vision, llm, arch)}
    assert paths == {
        "model.vision.fullatt_block_indexes",
        "model.llm.mrope_section",
        "model.arch.vision.deepstack_visual_indexes",
        "model.arch.vision.num_position_embeddings",
    }
    bad = _yaml("tiny_qwen3_vl")
    del bad.arch.llm.head_dim
    with pytest.raises(ConfigError, match=r"model\.arch\.llm"):
        family.hf_config(bad)


def test_qwen3_vl_checkpoint_keys_round_trip(family, tmp_path):
    cfg = family.tiny_hf_config()
    with torch.device("meta"):
        ref = family.reference_model(cfg)
    keys = list(ref.state_dict())
    assert any(k.startswith("model.visual.deepstack_merger_list.") for k in keys)
    for key in keys:
        module, fqn = family.checkpoint_owner(key)
        assert family.hf_key(module, fqn) == key
    assert family.checkpoint_owner("visual.blocks.0.attn.qkv.weight") is None
    with pytest.raises(CheckpointError, match="belong to no qwen3_vl module"):
        family.split_state_dict({"visual.pos_embed.weight": torch.zeros(1)})
    cfg.save_pretrained(tmp_path)
    assert family.hf_config_from_dir(tmp_path).to_dict() == cfg.to_dict()
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "qwen2_5_vl"}))
    with pytest.raises(CheckpointError, match="not a qwen3_vl model"):
        family.hf_config_from_dir(tmp_path)


def test_qwen3_vl_handoffs_one_edge_per_deepstack_level(family):
    cfg = family.tiny_hf_config()
    edges = family.handoffs_for(cfg)
    assert [e.kwarg for e in edges] == ["image_embeds", "deepstack_embeds_0", "deepstack_embeds_1"]
    assert {(e.producer, e.consumer, e.layout) for e in edges} == {("vision", "llm", "image_tokens")}
    assert family.handoff_width(cfg) == cfg.text_config.hidden_size
    assert dataclasses.is_dataclass(edges[0])
