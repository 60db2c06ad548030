"""The model-family protocol and the Qwen2.5-VL family: configs, meta builds, FQNs, key mapping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import Qwen2_5_VLTextConfig

from dhp.config.schema import ModelConfig
from dhp.errors import CheckpointError, ConfigError
from dhp.models import TINY_TOKENS, ModelFamily, get_arch, get_family
from dhp.models.qwen2_5_vl import LLMModule, VisionModule

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def family():
    return get_family("qwen2_5_vl")


@pytest.fixture(scope="module")
def hf_config(family):
    return family.hf_config(family.tiny_model_config())


def test_family_satisfies_protocol_and_graph(family, hf_config):
    assert isinstance(family, ModelFamily)
    assert family.module_names == ("vision", "llm")
    (edge,) = family.handoffs_for(hf_config)
    assert (edge.producer, edge.consumer, edge.kwarg, edge.layout) == (
        "vision",
        "llm",
        "image_embeds",
        "image_tokens",
    )
    assert (edge.width, edge.grad) == (hf_config.text_config.hidden_size, True)


def test_unknown_family_is_a_config_error():
    known = r"known: qwen2_5_omni, qwen2_5_vl, qwen3_5, qwen3_5_moe, qwen3_omni, qwen3_vl, qwen3_vl_moe"  # the flavour aliases among them
    with pytest.raises(ConfigError, match=rf"model.family = 'llama_vl'.*{known}"):
        get_family("llama_vl")
    with pytest.raises(ConfigError, match=rf"model.family = 'qwen3_vl_mo'.*{known}"):
        get_arch("qwen3_vl_mo")


def test_tiny_config_agrees_with_conf_model_tiny_yaml(family):
    yaml_cfg = OmegaConf.merge(
        OmegaConf.structured(ModelConfig), OmegaConf.load(REPO / "conf/model/tiny.yaml")
    )
    assert OmegaConf.to_object(yaml_cfg) == family.tiny_model_config()
    assert family.tiny_model_config().tokens == TINY_TOKENS


def test_hf_config_carries_the_schema_numbers(family, hf_config):
    v, t = hf_config.vision_config, hf_config.text_config
    assert (v.depth, v.hidden_size, v.num_heads, v.intermediate_size) == (4, 32, 4, 64)
    assert (v.window_size, list(v.fullatt_block_indexes), v.out_hidden_size) == (112, [1, 3], 128)
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads) == (
        128,
        2,
        8,
        4,
    )
    assert (t.intermediate_size, t.vocab_size) == (256, 1024)
    assert t.rope_parameters["mrope_section"] == [2, 3, 3]
    assert hf_config.image_token_id == TINY_TOKENS.image_token_id
    assert hf_config.dtype == torch.float32 and hf_config._attn_implementation == "sdpa"


def test_unknown_dtype_is_a_config_error(family):
    cfg = family.tiny_model_config()
    cfg.dtype = "fp8"
    with pytest.raises(ConfigError, match=r"model\.dtype = 'fp8'"):
        family.hf_config(cfg)


@pytest.mark.parametrize("name", ["vision", "llm"])
def test_meta_build_allocates_nothing_and_leaves_config_alone(family, hf_config, name):
    before = hf_config.to_json_string()
    module = family.build_module(name, hf_config, device="meta", dtype=torch.bfloat16)
    tensors = list(module.parameters()) + list(module.buffers())
    assert tensors and all(t.is_meta for t in tensors)
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    assert hf_config.to_json_string() == before


def test_module_fqns_follow_interfaces_md(family, hf_config):
    vision = family.build_module("vision", hf_config, device="meta", dtype=torch.float32)
    llm = family.build_module("llm", hf_config, device="meta", dtype=torch.float32)
    assert isinstance(vision, VisionModule) and isinstance(llm, LLMModule)
    vnames = {n for n, _ in vision.named_parameters()}
    lnames = {n for n, _ in llm.named_parameters()}
    for n in (
        "visual.patch_embed.proj.weight",
        "visual.blocks.3.attn.qkv.weight",
        "visual.merger.mlp.2.weight",
    ):
        assert n in vnames
    for n in (
        "language_model.embed_tokens.weight",
        "language_model.layers.1.mlp.down_proj.weight",
        "lm_head.weight",
    ):
        assert n in lnames
    assert all(n.startswith("visual.") for n in vnames)
    assert all(n.startswith(("language_model.", "lm_head.")) for n in lnames)


def test_random_build_on_a_device_is_initialised(family, hf_config):
    llm = family.build_module("llm", hf_config, device="cpu", dtype=torch.float32)
    w = llm.language_model.layers[0].self_attn.q_proj.weight
    assert 0.015 < w.std().item() < 0.025  # transformers' normal(0, initializer_range=0.02)
    assert 0.015 < llm.lm_head.weight.std().item() < 0.025
    rope = llm.language_model.rotary_emb
    assert torch.allclose(rope.inv_freq, rope.compute_default_rope_parameters(rope.config)[0])


def test_split_state_dict_covers_every_reference_tensor(family, hf_config):
    torch.manual_seed(0)
    ref = family.reference_model(hf_config)
    parts = family.split_state_dict(ref.state_dict())
    for name in family.module_names:
        module = family.build_module(name, hf_config, device="meta", dtype=torch.float32)
        assert set(parts[name]) == set(module.state_dict())
    assert sum(len(p) for p in parts.values()) == len(ref.state_dict())
    with pytest.raises(CheckpointError, match="belong to no qwen2_5_vl module"):
        family.split_state_dict({"vision_tower.x": torch.zeros(1)})


@pytest.mark.parametrize(
    ("key", "owner"),
    [
        ("model.visual.blocks.0.attn.qkv.weight", ("vision", "visual.blocks.0.attn.qkv.weight")),
        ("visual.merger.ln_q.weight", ("vision", "visual.merger.ln_q.weight")),
        ("model.language_model.norm.weight", ("llm", "language_model.norm.weight")),
        ("model.layers.0.mlp.up_proj.weight", ("llm", "language_model.layers.0.mlp.up_proj.weight")),
        ("lm_head.weight", ("llm", "lm_head.weight")),
        ("vision_tower.x", None),
    ],
)
def test_checkpoint_owner_accepts_both_hub_layouts(family, key, owner):
    assert family.checkpoint_owner(key) == owner


def test_text_only_config_has_only_the_llm(family):
    text_cfg = Qwen2_5_VLTextConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    assert family.modules_for(text_cfg) == ("llm",)
    with pytest.raises(ConfigError, match=r"Qwen2_5_VLTextConfig\) has modules \('llm',\)"):
        family.build_module("vision", text_cfg, device="meta", dtype=torch.float32)
    llm = family.build_module("llm", text_cfg, device="cpu", dtype=torch.float32)
    assert not llm.accepts_images


def test_tied_embeddings_share_storage(family):
    cfg = family.tiny_model_config()
    cfg.llm.tie_word_embeddings = True
    hf_config = family.hf_config(cfg)
    llm = family.build_module("llm", hf_config, device="cpu", dtype=torch.float32)
    assert llm.lm_head.weight is llm.language_model.embed_tokens.weight
    assert family.tied_parameters("llm", hf_config) == {
        "lm_head.weight": "language_model.embed_tokens.weight"
    }


def test_families_are_found_by_folder() -> None:
    from pathlib import Path

    from dhp.models.registry import ALIASES, family_names, get_family

    models = Path(__file__).resolve().parents[3] / "dhp" / "models"
    folders = sorted(p.parent.name for p in models.glob("*/family.py"))
    assert "qwen2_5_vl" in folders and set(ALIASES.values()) <= set(folders)
    assert family_names() == sorted(folders + list(ALIASES))  # a flavour's name is a family name too
    for alias, folder in ALIASES.items():
        held = get_family(alias)
        assert type(held) is type(get_family(folder)) and held.name == alias and held.model_types == (alias,)
