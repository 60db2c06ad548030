"""Qwen2.5-Omni family: the 7B's numbers, arch validation, planner counts vs the real modules (meta),
checkpoint keys (transformers 5's thinker, the released full model, the talker's keys owned by no
module), hand-offs, items and blank inputs, the TP plans, the audio processor, a meta build's buffers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dhp.config.issues import Issues
from dhp.errors import ConfigError
from dhp.models import get_arch, get_family

pytestmark = pytest.mark.unit
CONF = Path(__file__).resolve().parents[3] / "conf" / "model"


@pytest.fixture(scope="module")
def family():
    return get_family("qwen2_5_omni")


def _yaml(name: str):
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    cfg.attn_implementation = "sdpa"  # the 7B's flash_attention_2 is not installed on CPU
    return cfg


def test_qwen2_5_omni_7b_numbers_are_transformers_defaults_where_it_has_them(family):
    from transformers import Qwen2_5OmniThinkerConfig

    cfg, default = family.hf_config(_yaml("qwen2_5_omni_7b")), Qwen2_5OmniThinkerConfig()
    for part, keys in {
        "audio_config": ("d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim",
                         "num_mel_bins", "n_window", "max_source_positions", "output_dim"),
        "text_config": ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "vocab_size", "max_position_embeddings"),
        "vision_config": ("depth", "intermediate_size", "num_heads", "patch_size", "window_size",
                          "out_hidden_size", "fullatt_block_indexes"),
    }.items():  # fmt: skip
        for k in keys:
            assert _plain(getattr(getattr(cfg, part), k)) == _plain(getattr(getattr(default, part), k)), (
                part,
                k,
            )
    for k in ("audio_token_id", "image_token_id", "video_token_id", "audio_start_token_id",
              "audio_end_token_id", "position_id_per_seconds", "seconds_per_chunk"):  # fmt: skip
        assert getattr(cfg, k) == getattr(default, k), k
    assert cfg.vision_config.hidden_size == 1280 and cfg.vision_start_token_id == 151652


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def _meta_counts(family, cfg, name):
    module = family.build_module(name, cfg, device="meta", dtype=torch.bfloat16)
    blocks = {
        "audio": module.audio_tower.layers if name == "audio" else None,
        "vision": module.visual.blocks if name == "vision" else None,
        "llm": module.language_model.layers if name == "llm" else None,
    }[name]
    total = sum(p.numel() for p in module.parameters())
    block = max(sum(p.numel() for p in b.parameters()) for b in blocks)
    return total, block, max(p.numel() for p in module.parameters())


@pytest.mark.parametrize("which", ["tiny_qwen2_5_omni", "qwen2_5_omni_7b"])
def test_qwen2_5_omni_planner_counts_match_the_modules(family, which):
    model_cfg = _yaml(which)
    cfg = family.hf_config(model_cfg)
    typed = get_arch("qwen2_5_omni").architecture(model_cfg)
    assert list(typed.modules) == list(family.module_names) == ["audio", "vision", "llm"]
    for name in family.module_names:
        m = typed.modules[name]
        assert (m.params.total, m.block_params.total, m.largest_param) == _meta_counts(family, cfg, name), (
            name
        )
    if which == "qwen2_5_omni_7b":  # the thinker: 0.64B audio + 0.68B vision + 7.6B LLM
        sizes = {n: m.params.total / 1e9 for n, m in typed.modules.items()}
        assert 0.6 < sizes["audio"] < 0.7 and 0.6 < sizes["vision"] < 0.7 and 7.5 < sizes["llm"] < 7.7
    audio = typed.modules["audio"]
    assert audio.outputs == ("audio_embeds",) and typed.modules["llm"].inputs == (
        "audio_embeds",
        "image_embeds",
    )
    assert {b.attention.kind for b in audio.blocks} == {"window"} and not audio.blocks[0].mlp.gated
    assert (audio.input_row, audio.merge, audio.sp_unit) == (128, 4, 2 * model_cfg.audio.n_window)
    assert typed.capabilities.video and not typed.capabilities.packing


def test_qwen2_5_omni_bad_arch_numbers_are_config_errors():
    bad = _yaml("tiny_qwen2_5_omni")
    bad.audio.num_heads = 5
    bad.audio.max_source_positions = 2
    bad.llm.extra.pop("seconds_per_chunk")
    issues = Issues()
    get_arch("qwen2_5_omni").validate(bad, issues)
    assert {i.path for i in issues.items} == {
        "model.audio.hidden_size",
        "model.audio.max_source_positions",
        "model.llm.extra",
    }
    none = _yaml("tiny_qwen2_5_omni")
    none.audio.depth = 0
    issues = Issues()
    get_arch("qwen2_5_omni").validate(none, issues)
    assert [i.path for i in issues.items] == ["model.audio.depth"]
    clean = Issues()
    for name in ("tiny_qwen2_5_omni", "qwen2_5_omni_7b"):
        get_arch("qwen2_5_omni").validate(_yaml(name), clean)
    assert not clean.items


def test_qwen2_5_omni_checkpoint_keys(family):
    owner = family.checkpoint_owner
    assert owner("model.audio_tower.conv1.weight") == ("audio", "audio_tower.conv1.weight")
    assert owner("audio_tower.conv1.weight") == ("audio", "audio_tower.conv1.weight")
    assert owner("model.layers.0.mlp.up_proj.weight") == ("llm", "language_model.layers.0.mlp.up_proj.weight")
    assert owner("thinker.audio_tower.layers.0.fc1.bias") == ("audio", "audio_tower.layers.0.fc1.bias")
    assert owner("thinker.model.audio_tower.proj.weight") == ("audio", "audio_tower.proj.weight")
    assert owner("thinker.visual.blocks.3.attn.q.weight") == ("vision", "visual.blocks.3.attn.q.weight")
    assert owner("thinker.model.layers.1.mlp.up_proj.weight") == (
        "llm",
        "language_model.layers.1.mlp.up_proj.weight",
    )
    assert owner("thinker.model.language_model.norm.weight") == ("llm", "language_model.norm.weight")
    assert owner("thinker.lm_head.weight") == ("llm", "lm_head.weight")
    # the speech output: modules outside the graph (the loader reads them for no module)
    assert owner("talker.model.layers.0.mlp.up_proj.weight") == (
        "talker",
        "talker.model.layers.0.mlp.up_proj.weight",
    )
    assert owner("token2wav.code2wav_dit_model.proj.weight")[0] == "token2wav"
    assert not {"talker", "token2wav"} & set(family.module_names)
    # the export's names: transformers 5's thinker layout
    assert family.hf_key("audio", "audio_tower.conv2.bias") == "model.audio_tower.conv2.bias"
    assert (
        family.hf_key("llm", "language_model.embed_tokens.weight")
        == "model.language_model.embed_tokens.weight"
    )
    cfg = family.hf_config(_yaml("tiny_qwen2_5_omni"))
    ref = family.reference_model(cfg)  # every reference key has one owner and comes back as itself
    for key in ref.state_dict():
        assert family.hf_key(*family.checkpoint_owner(key)) == key


def test_qwen2_5_omni_handoffs_items_and_blank_inputs(family):
    cfg = family.hf_config(_yaml("tiny_qwen2_5_omni"))
    edges = family.handoffs_for(cfg)
    assert [(e.producer, e.kwarg, e.layout, e.width) for e in edges] == [
        ("audio", "audio_embeds", "audio_tokens", 128),
        ("vision", "image_embeds", "image_tokens", 128),
    ]
    audio = family.build_module("audio", cfg, device="cpu", dtype=torch.float32)
    lens = torch.tensor([1, 2, 3, 4, 5, 8, 9, 37, 240])
    rows = torch.randn(int(lens.sum()), 128)
    out = audio(input_features=rows, audio_lens=lens)["audio_embeds"]
    per_audio = family.tokens_per_item("audio", cfg, lens.reshape(-1, 1))
    assert sum(per_audio) == out.shape[0] and per_audio[:5] == [0, 0, 1, 1, 1]
    for name in ("audio", "vision"):
        rows, meta = family.blank_input(name, cfg)
        (shard,) = family.shard_inputs(name, cfg, rows=rows, meta=meta, sp_size=1)
        assert sum(family.tokens_per_item(name, cfg, meta)) == shard.num_tokens >= 1
    vision_rows, grids = family.blank_input("vision", cfg)
    with pytest.raises(ConfigError, match="no Ulysses SP"):
        family.shard_inputs("vision", cfg, pixel_values=vision_rows, image_grid_thw=grids, sp_size=2)
    strings = family.token_strings()
    assert strings["audio_token_id"] == "<|AUDIO|>" and strings["audio_start_token_id"] == "<|audio_bos|>"
    assert strings["audio_end_token_id"] == "<|audio_eos|>" and strings["image_token_id"] == "<|IMAGE|>"


def test_qwen2_5_omni_tp_plans_cover_every_linear_once(family):
    cfg = family.hf_config(_yaml("tiny_qwen2_5_omni"))
    for name in ("vision", "llm"):
        module = family.build_module(name, cfg, device="meta", dtype=torch.float32)
        globs = [g for g in module.parallel_plan.tp(False) if not g.endswith("embed_tokens")]
        patterns = [re.compile(re.escape(g).replace(r"\*", r"[^.]+") + "$") for g in globs]
        for fqn, sub in module.named_modules():
            if isinstance(sub, torch.nn.Linear):
                assert sum(bool(p.match(fqn)) for p in patterns) == 1, fqn
    audio_plan = family.parallel_plan("audio", cfg)
    assert audio_plan.tp is None and audio_plan.sp == () and audio_plan.blocks == ("audio_tower.layers.*",)
    assert family.parallel_plan("vision", cfg).sp == ()  # three q/k/v Linears: no Ulysses hooks
    axes = {
        n: get_arch("qwen2_5_omni").module_axes(n, _yaml("tiny_qwen2_5_omni")) for n in family.module_names
    }
    assert axes["audio"].sp and not axes["audio"].tp and not axes["vision"].sp and axes["vision"].tp
    assert axes["llm"].tp and axes["llm"].pp and not (axes["llm"].cp or axes["llm"].tp_sequence_parallel)


def test_qwen2_5_omni_meta_build_restores_the_audio_position_table(family):
    cfg = family.hf_config(_yaml("tiny_qwen2_5_omni"))
    torch.manual_seed(0)
    real = family.build_module("audio", cfg, device="cpu", dtype=torch.float32)
    meta = family.build_module("audio", cfg, device="meta", dtype=torch.float32)
    meta.to_empty(device="cpu")
    family.init_buffers("audio", meta)
    table = "audio_tower.positional_embedding.positional_embedding"
    assert torch.equal(dict(meta.named_buffers())[table], dict(real.named_buffers())[table])


def test_qwen2_5_omni_loads_the_whisper_feature_extractor(family, tmp_path):
    from transformers import WhisperFeatureExtractor

    WhisperFeatureExtractor(feature_size=128).save_pretrained(tmp_path)
    extractor = family.load_audio_processor(str(tmp_path))
    assert isinstance(extractor, WhisperFeatureExtractor) and extractor.feature_size == 128
    mel = extractor([torch.zeros(16000).numpy()], sampling_rate=16000, return_tensors="pt")["input_features"]
    assert mel.shape[1] == 128


def test_qwen2_5_omni_model_dir_loads_per_module_and_processes_inputs(family, tmp_path):
    """The tiny thinker directory: config, per-module loading (only that module's keys; a released
    model's talker/token2wav keys read by none), the tokenizer's audio tokens and chat template, the
    merged preprocessor config (image processor and WhisperFeatureExtractor)."""
    from PIL import Image
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, Qwen2_5OmniThinkerForConditionalGeneration

    from dhp.models.loading import build_and_load
    from dhp.models.tiny import make_tiny_checkpoint

    out = make_tiny_checkpoint(tmp_path / "tiny", family="qwen2_5_omni")
    cfg = family.hf_config_from_dir(out)
    built = family.hf_config(family.tiny_model_config())
    for part in ("audio_config", "vision_config", "text_config"):
        read, want = getattr(cfg, part).to_dict(), getattr(built, part).to_dict()
        assert {k: v for k, v in read.items() if k != "dtype"} == {
            k: v for k, v in want.items() if k != "dtype"
        }
    for k in ("audio_token_id", "audio_start_token_id", "vision_start_token_id", "image_token_id"):
        assert getattr(cfg, k) == getattr(built, k), k
    ref = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    split = family.split_state_dict(ref.state_dict())
    weights = load_file(str(out / "model.safetensors"))
    speech = {"talker.thinker_to_talker_proj.weight": torch.zeros(2, 2), "token2wav.x.weight": torch.zeros(2)}
    save_file({**weights, **speech}, str(out / "model.safetensors"))
    for name in family.module_names:
        module, report = build_and_load(family, name, out, hf_config=cfg, dtype=torch.float32, device="cpu")
        assert {family.checkpoint_owner(k)[0] for k in report.keys_read} == {name}
        assert all(torch.equal(t, split[name][k]) for k, t in module.state_dict().items() if k in split[name])
        assert set(split[name]) <= set(module.state_dict()), name

    tok = AutoTokenizer.from_pretrained(str(out))
    tokens = family.tiny_model_config().tokens
    assert {k: tok.convert_tokens_to_ids(s) for k, s in family.token_strings().items()} == {
        k: getattr(tokens, k) for k in family.token_strings()
    }
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "audio"}, {"type": "image"}, {"type": "text", "text": "Hi"}]}],
        tokenize=False,
    )
    assert "<|audio_bos|><|AUDIO|><|audio_eos|><|vision_bos|><|IMAGE|><|vision_eos|>Hi" in text
    features = family.load_audio_processor(str(out))
    mel = features([torch.zeros(8000).numpy()], sampling_rate=16000, return_tensors="pt")["input_features"]
    assert mel.shape[1] == cfg.audio_config.num_mel_bins
    proc = family.load_image_processor(str(out), min_pixels=56 * 56, max_pixels=112 * 112)
    got = proc(images=[Image.new("RGB", (112, 56))], return_tensors="pt")
    assert got["image_grid_thw"].tolist() == [[1, 4, 8]]
