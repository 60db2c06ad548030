"""Qwen3-VL family: published numbers, arch validation, planner counts vs the real modules, key maps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dhp.config.issues import Issues
from dhp.errors import CheckpointError, ConfigError
from dhp.models import get_arch, get_family
from dhp.models.qwen3_vl.arch import ARCH

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
    assert family.hf_config(family.tiny_model_config()).to_dict() == from_yaml


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
    from_hf = ARCH.architecture_of(ARCH.numbers_from_hf(cfg))
    for name in family.module_names:
        total, block, biggest = _meta_counts(family, cfg, name)
        typed = [from_hf.modules[name]]
        if model_cfg is not None:  # the planner reads the schema's numbers
            typed.append(get_arch("qwen3_vl").architecture(model_cfg).modules[name])
        for m in typed:
            assert (m.params.total, m.block_params.total, m.largest_param) == (total, block, biggest), name


def test_qwen3_vl_32b_typed_architecture(family):
    arch = get_arch("qwen3_vl")
    model = _yaml("qwen3_vl_32b")
    typed = arch.architecture(model)
    llm, vision = typed.modules["llm"], typed.modules["vision"]
    assert {b.attention.head_dim for b in llm.blocks} == {128} and llm.hidden == 5120  # not 5120 / 64
    assert vision.count("full") == vision.layers == 27 and vision.sp_exchange_blocks == 27
    assert {b.mlp.gated for b in vision.blocks} == {False}  # linear_fc1 -> act -> linear_fc2
    assert vision.handoff_width == 4 * 5120  # image_embeds + 3 DeepStack levels
    assert vision.outputs == llm.inputs == ("image_embeds", *(f"deepstack_embeds_{k}" for k in range(3)))
    assert llm.layer_shape().kv_dim == 8 * 128
    assert typed.capabilities.packing and not typed.capabilities.video  # tests/parity/test_packing.py


def test_qwen3_vl_bad_arch_numbers_are_config_errors(family):
    bad = _yaml("tiny_qwen3_vl")
    bad.llm.extra.mrope_section = [4, 4, 4]
    bad.vision.extra.deepstack_visual_indexes = [0, 3]
    bad.vision.extra.num_position_embeddings = 15
    issues = Issues()
    get_arch("qwen3_vl").validate(bad, issues)
    assert {i.path for i in issues.items} == {
        "model.llm.extra.mrope_section",
        "model.vision.extra.deepstack_visual_indexes",
        "model.vision.extra.num_position_embeddings",
    }
    missing = _yaml("tiny_qwen3_vl")
    del missing.llm.extra.head_dim
    with pytest.raises(ConfigError, match=r"model\.llm\.extra"):
        family.hf_config(missing)


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
    assert {(e.producer, e.consumer, e.layout, e.width, e.grad) for e in edges} == {
        ("vision", "llm", "image_tokens", cfg.text_config.hidden_size, True)
    }


def test_qwen3_vl_sp_shards_cut_merge_units_and_feed_the_module_forward(family):
    """sp=1: the shard's precomputed kwargs give exactly the module's own outputs; sp=3: contiguous,
    merge-unit-aligned row slices whose metadata concatenates to the whole batch's."""
    from dhp.models.testing import tiny_vl_batch

    cfg = family.tiny_hf_config()
    batch = tiny_vl_batch(cfg, images=[[(8, 6), (4, 10)], [(2, 2)]], text_lens=[3, 4], seed=2)
    pixels, grid = batch["pixel_values"], batch["image_grid_thw"]
    torch.manual_seed(0)
    vision = family.build_module("vision", cfg, device="cpu", dtype=torch.float32)
    (whole,) = family.shard_inputs("vision", cfg, pixel_values=pixels, image_grid_thw=grid, sp_size=1)
    with torch.no_grad():
        direct = vision(pixels, grid)
        via_shard = vision(**whole.forward_kwargs())
    assert set(direct) == {e.kwarg for e in family.handoffs_for(cfg)}
    assert all(torch.equal(direct[k], via_shard[k]) for k in direct)
    assert whole.num_tokens == sum(family.tokens_per_image(cfg, grid)) == direct["image_embeds"].shape[0]

    shards = family.shard_inputs("vision", cfg, pixel_values=pixels, image_grid_thw=grid, sp_size=3)
    assert [s.num_patches % 4 for s in shards] == [0, 0, 0]
    assert max(s.num_patches for s in shards) - min(s.num_patches for s in shards) <= 4
    assert torch.equal(torch.cat([s.token_index for s in shards]), torch.arange(whole.num_tokens))
    for key in ("pixel_values", "interp_indices", "interp_weights", "position_ids"):
        assert torch.equal(torch.cat([getattr(s, key) for s in shards]), getattr(whole, key)), key
        # each rank's rows only: a view would keep (and ship, and save for backward) the whole batch
        for s in shards:
            t = getattr(s, key)
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), key
    assert all(torch.equal(s.cu_seqlens, whole.cu_seqlens) for s in shards)
    assert shards[0].forward_kwargs()["ulysses_split_sizes"] == tuple(s.num_patches for s in shards)


def test_qwen3_vl_tp_plan_covers_every_linear_once(family):
    """Every nn.Linear of both modules (DeepStack mergers included) matches exactly one TP glob."""
    import re

    cfg = family.tiny_hf_config()
    for name in family.module_names:
        module = family.build_module(name, cfg, device="meta", dtype=torch.float32)
        plan = module.parallel_plan
        assert plan.blocks == family.parallel_plan(name, cfg).blocks
        globs = [g for g in plan.tp(False) if not g.endswith(("embed_tokens", "language_model"))]
        patterns = [re.compile(re.escape(g).replace(r"\*", r"[^.]+") + "$") for g in globs]
        for fqn, sub in module.named_modules():
            if isinstance(sub, torch.nn.Linear):
                hits = [g for g, p in zip(globs, patterns, strict=True) if p.match(fqn)]
                assert len(hits) == 1, (fqn, hits)
    assert family.parallel_plan("vision", cfg).sp[0].modules == "visual.blocks.*.attn"
    assert not family.parallel_plan("llm", cfg).tp_sequence_parallel


def test_qwen3_vl_model_dir_loads_per_module_and_processes_images(family, tmp_path):
    """A tiny Qwen3-VL HF directory: config, per-module loading (only that module's keys) and the
    image processor (patch 16) agree with the family; the loaded modules give the reference's outputs."""
    from PIL import Image
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    from dhp.models.loading import build_and_load
    from dhp.models.tiny import make_tiny_checkpoint

    out = make_tiny_checkpoint(tmp_path / "tiny", family="qwen3_vl")
    cfg = family.hf_config_from_dir(out)
    assert ARCH.numbers_from_hf(cfg) == ARCH.numbers_from_hf(family.tiny_hf_config())
    ref = Qwen3VLForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    split = family.split_state_dict(ref.state_dict())
    for name in family.module_names:
        module, report = build_and_load(family, name, out, hf_config=cfg, dtype=torch.float32, device="cpu")
        assert {family.checkpoint_owner(k)[0] for k in report.keys_read} == {name}
        assert all(torch.equal(t, split[name][k]) for k, t in module.state_dict().items()), name

    proc = family.load_image_processor(str(out), min_pixels=32 * 32, max_pixels=128 * 128)
    image = Image.new("RGB", (96, 64), color=(200, 30, 40))
    got = proc(images=[image], return_tensors="pt")
    ((t, h, w),) = got["image_grid_thw"].tolist()
    assert (t, h, w) == (1, 64 // 16, 96 // 16) and got["pixel_values"].shape == (h * w, 3 * 2 * 16 * 16)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert {k: tok.convert_tokens_to_ids(s) for k, s in family.token_strings().items()} == {
        k: getattr(family.tiny_model_config().tokens, k) for k in family.token_strings()
    }
