"""Qwen3.5 family: published numbers, arch validation, hybrid layer kinds, planner counts vs the real
modules, key maps, the shared encoder without DeepStack, the TP plans."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dhp.config.issues import Issues
from dhp.errors import CheckpointError, ConfigError
from dhp.models import get_arch, get_family
from dhp.models.qwen3_5.arch import ARCH

pytestmark = pytest.mark.unit
CONF = Path(__file__).resolve().parents[3] / "conf" / "model"


@pytest.fixture(scope="module")
def family():
    return get_family("qwen3_5")


def _yaml(name: str):
    return OmegaConf.load(CONF / f"{name}.yaml")


def test_qwen3_5_27b_published_numbers(family):
    """The released Qwen/Qwen3.5-27B config.json numbers (see the YAML header)."""
    cfg = family.hf_config(_yaml("qwen3_5_27b"))
    t, v = cfg.text_config, cfg.vision_config
    got = (
        t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
        t.intermediate_size, t.vocab_size, t.linear_num_key_heads, t.linear_num_value_heads,
        t.linear_key_head_dim, t.linear_value_head_dim, t.linear_conv_kernel_dim,
    )  # fmt: skip
    assert got == (5120, 64, 24, 4, 256, 17408, 248320, 16, 48, 128, 128, 4)
    assert t.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 16
    rope = t.rope_parameters
    assert (rope["rope_theta"], rope["partial_rotary_factor"], rope["mrope_section"]) == (
        1e7,
        0.25,
        [11, 11, 10],
    )
    assert rope["mrope_interleaved"] and t.max_position_embeddings == 262144
    vision = (v.depth, v.hidden_size, v.num_heads, v.intermediate_size, v.patch_size, v.out_hidden_size)
    assert vision == (27, 1152, 16, 4304, 16, 5120) and v.num_position_embeddings == 2304
    assert not hasattr(v, "deepstack_visual_indexes") and not cfg.tie_word_embeddings
    assert (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id) == (248056, 248057, 248053)


def test_qwen3_5_tiny_yaml_is_the_tiny_config(family):
    from_yaml = family.hf_config(_yaml("tiny_qwen3_5")).to_dict()
    assert from_yaml == family.tiny_hf_config().to_dict()
    kinds = family.tiny_hf_config().text_config.layer_types
    assert "linear_attention" in kinds and "full_attention" in kinds


def _meta_counts(family, cfg, name):
    module = family.build_module(name, cfg, device="meta", dtype=torch.bfloat16)
    total = sum(p.numel() for p in module.parameters())
    blocks = module.visual.blocks if name == "vision" else module.language_model.layers
    block = max(sum(p.numel() for p in b.parameters()) for b in blocks)
    biggest = max(p.numel() for p in module.parameters())
    return total, block, biggest


@pytest.mark.parametrize("which", ["tiny", "tiny_tied", "qwen3_5_27b"])
def test_qwen3_5_planner_counts_match_the_modules(family, which):
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
            typed.append(get_arch("qwen3_5").architecture(model_cfg).modules[name])
        for m in typed:
            assert (m.params.total, m.block_params.total, m.largest_param) == (total, block, biggest), name
    if which == "qwen3_5_27b":  # "27B": 26.9B LLM + 0.46B encoder
        assert 27.3e9 < sum(m.params.total for m in from_hf.modules.values()) < 27.4e9


def test_qwen3_5_27b_typed_architecture_declares_the_hybrid_layers():
    arch = get_arch("qwen3_5")
    model = _yaml("qwen3_5_27b")
    typed = arch.architecture(model)
    llm, vision = typed.modules["llm"], typed.modules["vision"]
    kinds = [b.attention.kind for b in llm.blocks]
    assert kinds == (["linear"] * 3 + ["full"]) * 16 and llm.count("linear") == 48 and llm.count("full") == 16
    linear = llm.blocks[0].attention
    assert (linear.heads, linear.kv_heads, linear.head_dim, linear.state) == (48, 16, 128, 128 * 128)
    full = llm.blocks[3].attention
    assert (full.heads, full.kv_heads, full.head_dim, full.causal) == (24, 4, 256, True)
    # a DeltaNet layer has no scores (span 0): its mixing is the chunked delta rule, a constant cost
    # per token whatever S; a full layer's span grows with S
    assert linear.span(seq_len=4096, sample=0) == linear.span(seq_len=8192, sample=0) == 0
    assert linear.delta_rule_flops() == 2 * 48 * (64 * (2.5 * 128 + 1.5 * 128) + 3 * 128 * 128)
    assert full.span(seq_len=8192, sample=0) == 2 * full.span(seq_len=4096, sample=0)
    assert vision.count("full") == vision.layers == 27 and vision.outputs == llm.inputs == ("image_embeds",)
    assert vision.handoff_width == 5120  # no DeepStack: one edge
    assert typed.capabilities.packing and not typed.capabilities.video  # tests/parity/test_packing.py


def test_qwen3_5_bad_arch_numbers_are_config_errors(family):
    bad = _yaml("tiny_qwen3_5")
    bad.llm.extra.mrope_section = [4, 4, 4]
    bad.llm.extra.linear_num_key_heads = 3
    bad.vision.extra.num_position_embeddings = 15
    issues = Issues()
    get_arch("qwen3_5").validate(bad, issues)
    assert {i.path for i in issues.items} == {
        "model.llm.extra.mrope_section",
        "model.llm.extra.linear_num_key_heads",
        "model.vision.extra.num_position_embeddings",
    }
    deepstack = _yaml("tiny_qwen3_5")
    deepstack.vision.extra.deepstack_visual_indexes = [0]  # Qwen3.5's encoder has no DeepStack
    with pytest.raises(ConfigError, match=r"model\.vision\.extra"):
        family.hf_config(deepstack)
    missing = _yaml("tiny_qwen3_5")
    del missing.llm.extra.linear_conv_kernel_dim
    with pytest.raises(ConfigError, match=r"model\.llm\.extra"):
        family.hf_config(missing)
    zero = _yaml("tiny_qwen3_5")
    zero.llm.extra.full_attention_interval = 0
    issues = Issues()
    get_arch("qwen3_5").validate(zero, issues)
    assert [i.path for i in issues.items] == ["model.llm.extra.full_attention_interval"]


def test_qwen3_5_checkpoint_keys_round_trip(family, tmp_path):
    cfg = family.tiny_hf_config()
    with torch.device("meta"):
        ref = family.reference_model(cfg)
    keys = list(ref.state_dict())
    assert any(".linear_attn.A_log" in k for k in keys) and any(".self_attn.q_norm." in k for k in keys)
    for key in keys:
        module, fqn = family.checkpoint_owner(key)
        assert family.hf_key(module, fqn) == key
    assert family.checkpoint_owner("visual.blocks.0.attn.qkv.weight") is None
    with pytest.raises(CheckpointError, match="belong to no qwen3_5 module"):
        family.split_state_dict({"visual.pos_embed.weight": torch.zeros(1)})
    cfg.save_pretrained(tmp_path)
    assert family.hf_config_from_dir(tmp_path).to_dict() == cfg.to_dict()
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "qwen3_vl"}))
    with pytest.raises(CheckpointError, match="not a qwen3_5 model"):
        family.hf_config_from_dir(tmp_path)


def test_qwen3_5_handoffs_one_edge(family):
    cfg = family.tiny_hf_config()
    (edge,) = family.handoffs_for(cfg)
    assert (edge.producer, edge.consumer, edge.kwarg, edge.layout, edge.width, edge.grad) == (
        "vision", "llm", "image_embeds", "image_tokens", cfg.text_config.hidden_size, True
    )  # fmt: skip


def test_qwen3_5_sp_shards_feed_the_module_forward(family):
    """The shared SP cut works on Qwen3.5's encoder: sp=1 gives the module's own output; sp=2 shards
    concatenate to the whole batch's rows."""
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
    assert set(direct) == {"image_embeds"} and torch.equal(direct["image_embeds"], via_shard["image_embeds"])
    assert whole.num_tokens == sum(family.tokens_per_image(cfg, grid)) == direct["image_embeds"].shape[0]
    shards = family.shard_inputs("vision", cfg, pixel_values=pixels, image_grid_thw=grid, sp_size=2)
    assert torch.equal(torch.cat([s.token_index for s in shards]), torch.arange(whole.num_tokens))
    assert shards[0].forward_kwargs()["ulysses_split_sizes"] == tuple(s.num_patches for s in shards)


def test_qwen3_5_tp_plans_cover_every_linear_once(family):
    """Every nn.Linear of both modules matches exactly one TP glob (no DeepStack globs in the encoder),
    except inside a Gated DeltaNet, whose one style owns all its parameters; the runtime plan and the
    declared axes agree on TP with sequence parallelism and on what each degree must divide."""
    cfg = family.tiny_hf_config()
    for name in family.module_names:
        module = family.build_module(name, cfg, device="meta", dtype=torch.float32)
        globs = [
            g for g in module.parallel_plan.tp(False) if not g.endswith(("embed_tokens", "language_model"))
        ]
        assert not any("deepstack" in g for g in globs)
        patterns = [re.compile(re.escape(g).replace(r"\*", r"[^.]+") + "$") for g in globs]
        for fqn, sub in module.named_modules():
            hits = sum(bool(p.match(fqn)) for p in patterns)
            owned = ".linear_attn." in fqn  # the DeltaNet style shards its children itself
            if fqn.endswith(".linear_attn") or (isinstance(sub, torch.nn.Linear) and not owned):
                assert hits == 1, fqn
            elif owned:
                assert hits == 0, fqn
    assert family.parallel_plan("vision", cfg).sp[0].modules == "visual.blocks.*.attn"
    llm_plan = family.parallel_plan("llm", cfg)
    assert llm_plan.tp_sequence_parallel and llm_plan.loss and llm_plan.blocks == ("language_model.layers.*",)
    axes = get_arch("qwen3_5").module_axes("llm", _yaml("tiny_qwen3_5"))
    assert axes.tp and axes.tp_sequence_parallel and not axes.sp
    assert sorted(axes.tp_divides.values()) == sorted(llm_plan.tp_divides.values())
    big = get_arch("qwen3_5").module_axes("llm", _yaml("qwen3_5_27b"))
    assert big.tp_divides["model.llm.num_kv_heads"] == 4  # TP=8 is refused for the 27B: 4 KV heads


def test_qwen3_5_model_dir_loads_per_module_and_processes_images(family, tmp_path):
    """A tiny Qwen3.5 HF directory: config, per-module loading (only that module's keys) and the image
    processor (patch 16) agree with the family; the loaded modules hold the reference's weights."""
    from PIL import Image
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    from dhp.models.loading import build_and_load
    from dhp.models.tiny import make_tiny_checkpoint

    out = make_tiny_checkpoint(tmp_path / "tiny", family="qwen3_5")
    cfg = family.hf_config_from_dir(out)
    assert ARCH.numbers_from_hf(cfg) == ARCH.numbers_from_hf(family.tiny_hf_config())
    ref = Qwen3_5ForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    split = family.split_state_dict(ref.state_dict())
    for name in family.module_names:
        module, report = build_and_load(family, name, out, hf_config=cfg, dtype=torch.float32, device="cpu")
        assert {family.checkpoint_owner(k)[0] for k in report.keys_read} == {name}
        assert all(torch.equal(t, split[name][k]) for k, t in module.state_dict().items()), name

    # the release also stores a multi-token-prediction head (mtp.*): no module of the graph reads it
    from safetensors.torch import load_file, save_file

    weights = load_file(str(out / "model.safetensors"))
    save_file({**weights, "mtp.fc.weight": torch.zeros(2, 2)}, str(out / "model.safetensors"))
    for name in family.module_names:
        _, report = build_and_load(family, name, out, hf_config=cfg, dtype=torch.float32, device="cpu")
        assert not any(k.startswith("mtp.") for k in report.keys_read)
    assert (
        family.checkpoint_owner("mtp.fc.weight") == ("mtp", "fc.weight") and "mtp" not in family.module_names
    )

    proc = family.load_image_processor(str(out), min_pixels=32 * 32, max_pixels=128 * 128)
    got = proc(images=[Image.new("RGB", (96, 64), color=(200, 30, 40))], return_tensors="pt")
    ((t, h, w),) = got["image_grid_thw"].tolist()
    assert (t, h, w) == (1, 64 // 16, 96 // 16) and got["pixel_values"].shape == (h * w, 3 * 2 * 16 * 16)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert {k: tok.convert_tokens_to_ids(s) for k, s in family.token_strings().items()} == {
        k: getattr(family.tiny_model_config().tokens, k) for k in family.token_strings()
    }


# --- the MoE flavour ----------------------------------------------------------------------------------
def _moe_yaml(name: str):
    model = _yaml(name)
    model.attn_implementation = "sdpa"  # the YAML's flash_attention_2 is not installed on CPU
    return model


def test_qwen3_5_35b_a3b_published_numbers(family):
    """Qwen/Qwen3.5-35B-A3B (see the YAML header): transformers' Qwen3_5MoeTextConfig defaults."""
    from transformers import Qwen3_5MoeConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    cfg = family.hf_config(_moe_yaml("qwen3_5_35b_a3b"))
    assert isinstance(cfg, Qwen3_5MoeConfig) and cfg.architectures == ["Qwen3_5MoeForConditionalGeneration"]
    t, v, d = cfg.text_config, cfg.vision_config, Qwen3_5MoeTextConfig()
    keys = (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "vocab_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
        "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size", "shared_expert_intermediate_size", "router_aux_loss_coef", "layer_types",
    )  # fmt: skip
    assert [getattr(t, k) for k in keys] == [getattr(d, k) for k in keys]
    got = tuple(getattr(t, k) for k in keys[:16])
    assert got == (2048, 40, 16, 2, 256, 248320, 16, 32, 128, 128, 4, 256, 8, 512, 512, 0.001)
    assert t.max_position_embeddings == 262144 and not cfg.tie_word_embeddings
    assert (v.depth, v.hidden_size, v.out_hidden_size) == (27, 1152, 2048)


@pytest.mark.parametrize("which", ["tiny_qwen3_5_moe", "qwen3_5_35b_a3b"])
def test_qwen3_5_moe_counts_match_the_modules(family, which):
    """Total, per-block, largest tensor and the routed experts' count of the meta-built modules equal
    the planner's; the 35B-A3B totals 35.1B with ~3B (LLM, input table excluded) active per token."""
    model_cfg = _moe_yaml(which)
    cfg = family.hf_config(model_cfg)
    n = ARCH.numbers_from_hf(cfg)
    assert n.moe and n == ARCH.numbers(model_cfg)
    planned = get_arch("qwen3_5").architecture(model_cfg).modules
    assert planned == ARCH.architecture_of(n).modules  # the schema's numbers and the config's agree
    for name in family.module_names:
        total, block, biggest = _meta_counts(family, cfg, name)
        m = planned[name]
        assert (m.params.total, m.block_params.total, m.largest_param) == (total, block, biggest), name
    llm = family.build_module("llm", cfg, device="meta", dtype=torch.bfloat16)
    experts = sum(p.numel() for f, p in llm.named_parameters() if ".mlp.experts." in f)
    typed = planned["llm"]
    assert typed.params.expert == experts > 0
    mlp = typed.blocks[0].mlp
    assert (mlp.kind, mlp.experts, mlp.top_k, mlp.intermediate, mlp.shared) == (
        "moe", n.experts, n.top_k, n.moe_mlp, n.mlp
    )  # fmt: skip
    assert {b.mlp for b in typed.blocks} == {mlp}  # every layer sparse
    idle = n.layers * (n.experts - n.top_k) * 3 * n.moe_mlp * n.hidden  # experts a token skips
    assert typed.active_params == typed.params.total - idle
    if which == "qwen3_5_35b_a3b":
        total = sum(m.params.total for m in planned.values())
        active = sum(m.active_params for m in planned.values())
        # "35B-A3B": 35.1B in all; the 3B active are the LLM's parameters one token passes through
        # with lm_head but not the input embedding table (a lookup): 2.95B (3.9B with both tables
        # and the encoder)
        table = n.vocab * n.hidden
        assert 35.0e9 < total < 35.5e9, total
        assert 2.9e9 < active - table - planned["vision"].params.total < 3.0e9, active


def test_qwen3_5_moe_parallel_plan_declares_the_experts(family):
    """moe_blocks/experts for EP; the shared expert's Linears are TP-sharded (one glob each), its gate,
    the router and the experts are not; no sequence parallelism inside TP for the MoE flavour."""
    cfg = family.tiny_hf_config(moe=True)
    plan = family.parallel_plan("llm", cfg)
    assert (plan.moe_blocks, plan.experts) == ("language_model.layers.*.mlp", 8)
    assert not plan.tp_sequence_parallel
    assert plan.tp_divides["model.llm.intermediate_size"] == 32  # the shared expert's width
    module = family.build_module("llm", cfg, device="meta", dtype=torch.float32)
    globs = [g for g in plan.tp(False) if not g.endswith("embed_tokens")]
    patterns = [re.compile(re.escape(g).replace(r"\*", r"[^.]+") + "$") for g in globs]
    for fqn, sub in module.named_modules():
        hits = sum(bool(p.match(fqn)) for p in patterns)
        if ".shared_expert." in fqn and isinstance(sub, torch.nn.Linear):
            assert hits == 1, fqn
        elif fqn.endswith((".mlp.gate", ".mlp.experts", ".shared_expert_gate")):
            assert hits == 0, fqn
    axes = get_arch("qwen3_5").module_axes("llm", _yaml("tiny_qwen3_5_moe"))
    assert axes.tp and not axes.tp_sequence_parallel
    assert sorted(axes.tp_divides.values()) == sorted(plan.tp_divides.values())


def test_qwen3_5_moe_bad_numbers_are_config_errors(family):
    bad = _yaml("tiny_qwen3_5_moe")
    bad.llm.extra.num_experts_per_tok = 9
    bad.llm.extra.router_aux_loss_coef = -1.0
    issues = Issues()
    get_arch("qwen3_5").validate(bad, issues)
    assert {i.path for i in issues.items} == {
        "model.llm.extra.num_experts_per_tok",
        "model.llm.extra.router_aux_loss_coef",
    }
    partial = _yaml("tiny_qwen3_5_moe")
    del partial.llm.extra.moe_intermediate_size  # the MoE keys come all together
    with pytest.raises(ConfigError, match=r"qwen3_5_35b_a3b"):
        family.hf_config(partial)


def test_qwen3_5_moe_checkpoint_keys_round_trip(family, tmp_path):
    """Every key of transformers' MoE model (3-D experts) maps to a module and back; a qwen3_5_moe
    config.json reads back as the MoE config."""
    cfg = family.tiny_hf_config(moe=True)
    with torch.device("meta"):
        ref = family.reference_model(cfg)
    keys = list(ref.state_dict())
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in keys
    assert "model.language_model.layers.0.mlp.shared_expert_gate.weight" in keys
    for key in keys:
        module, fqn = family.checkpoint_owner(key)
        assert family.hf_key(module, fqn) == key
    cfg.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    assert family.hf_config_from_dir(tmp_path).to_dict() == cfg.to_dict()
