"""A dhp checkpoint of the three Qwen3-Omni modules -> HF directory (``dhp.checkpoint.export``).

Thinker-only source (no ``model.path``): transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration``
loads the export with every tensor bit-equal to the model the modules came from (the fused experts
``mlp.experts.gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] in the layout the installed
transformers holds them) and bit-equal logits of a padded image + audio batch.

Full source (``model.path`` a sharded ``Qwen3OmniMoeForConditionalGeneration`` directory: ``thinker.*``,
``talker.*``, ``code2wav.*``): the export has the source's keys and config; its talker and code2wav
tensors are the source's bytes; its thinker tensors are the trained ones (a thinker other than the
source's), and ``Qwen3OmniMoeForConditionalGeneration.from_pretrained`` loads it with no key missing,
unexpected or mismatched, its thinker's logits bit-equal to the trained thinker's. A full source in the
release's layout (every MoE layer one tensor per expert, the talker's too) gets the trained experts back
per expert under its keys; a thinker-only source stored per expert gets the fused thinker export. All
fp32 on CPU: tolerance 0.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from export_checks import assert_rebuilt, checkpoint_of, stored
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeThinkerForConditionalGeneration

from dhp.checkpoint.export import export_hf
from dhp.errors import CheckpointError
from dhp.models import get_family
from dhp.models.qwen3_omni.audio import audio_token_counts
from dhp.models.qwen3_omni.tiny import write_tiny_full_checkpoint
from dhp.models.tiny import make_tiny_checkpoint, write_per_expert_copy

pytestmark = [pytest.mark.parity, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
TEXT_IDS = (20, 400)  # random text ids: above the specials, below the tiny audio tokens (433..435)
# per record: text tokens, an image's (h, w) patches or None, an audio's mel frames or None
RECORDS = [(3, (8, 6), 150), (5, None, 260)]
PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def hf_batch(cfg) -> dict[str, torch.Tensor]:
    """A right-padded batch of :data:`RECORDS` as the thinker's forward takes it (padded
    ``input_features`` with their ``feature_attention_mask``), drawn from a fixed seed."""
    gen = torch.Generator().manual_seed(1)
    v, mels = cfg.vision_config, cfg.audio_config.num_mel_bins
    width = v.in_channels * v.temporal_patch_size * v.patch_size**2
    rows, pixels, grids, audios = [], [], [], []
    for n_text, image, frames in RECORDS:
        ids = torch.randint(*TEXT_IDS, (n_text,), generator=gen).tolist()
        if image is not None:
            grids.append([1, *image])
            pixels.append(torch.randn(image[0] * image[1], width, generator=gen))
            n = image[0] * image[1] // v.spatial_merge_size**2
            ids += [cfg.vision_start_token_id, *[cfg.image_token_id] * n, cfg.vision_end_token_id]
        if frames is not None:
            audios.append(torch.randn(frames, mels, generator=gen))
            n = audio_token_counts(torch.tensor([frames]), n_window=cfg.audio_config.n_window)[0]
            ids += [cfg.audio_start_token_id, *[cfg.audio_token_id] * n, cfg.audio_end_token_id]
        rows.append(ids + torch.randint(*TEXT_IDS, (2,), generator=gen).tolist())
    seq = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), seq), cfg.text_config.pad_token_id or 0, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, r in enumerate(rows):
        input_ids[b, : len(r)], attention_mask[b, : len(r)] = torch.tensor(r), 1
    longest = max(a.shape[0] for a in audios)
    features = torch.zeros(len(audios), mels, longest)
    feature_mask = torch.zeros(len(audios), longest, dtype=torch.long)
    for i, a in enumerate(audios):
        features[i, :, : a.shape[0]], feature_mask[i, : a.shape[0]] = a.T, 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": torch.cat(pixels),
        "image_grid_thw": torch.tensor(grids),
        "input_features": features,
        "feature_attention_mask": feature_mask,
    }


def _quiet_load(cls, path: Path, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_pretrained(str(path), dtype=torch.float32, **kwargs)


def test_thinker_export_loads_in_transformers_with_equal_tensors_and_logits(tmp_path: Path) -> None:
    family = get_family("qwen3_omni")
    model_cfg = family.tiny_model_config()
    hf_config = family.hf_config(model_cfg)
    torch.manual_seed(0)
    ref = family.reference_model(hf_config).float()
    ckpt = checkpoint_of(family, hf_config, ref, tmp_path / "ckpts")
    out = export_hf(ckpt, out_dir=tmp_path / "hf", model=model_cfg, max_shard_bytes=512 * 1024)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    loaded, info = _quiet_load(Qwen3OmniMoeThinkerForConditionalGeneration, out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    want, got = ref.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    assert not [k for k in want if not torch.equal(got[k], want[k])]
    experts = got["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    t = hf_config.text_config
    assert experts.shape == (t.num_experts, 2 * t.moe_intermediate_size, t.hidden_size)
    batch = hf_batch(hf_config)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, ref(**batch).logits)


def test_a_thinker_source_stored_per_expert_gets_the_fused_thinker_export(tmp_path: Path) -> None:
    """``model.path`` a thinker-only directory whose experts are stored one tensor per expert: no other
    module to carry, so the export writes the thinker as transformers holds it (the fused experts, the
    family's own keys, as without ``model.path``), which ``Qwen3OmniMoeThinkerForConditionalGeneration``
    loads with every tensor bit-equal to the trained ones."""
    family = get_family("qwen3_omni")
    fused = make_tiny_checkpoint(tmp_path / "fused", model_cfg=family.tiny_model_config(), sharded=True)
    src = write_per_expert_copy(fused, tmp_path / "src", folds=family.expert_folds)
    assert any(PER_EXPERT.search(k) for k in stored(src))
    model_cfg = dataclasses.replace(family.tiny_model_config(), path=str(src))
    hf_config = family.hf_config_from_dir(src)
    torch.manual_seed(0)
    ref = family.reference_model(hf_config).float()
    ckpt = checkpoint_of(family, hf_config, ref, tmp_path / "ckpts")
    out = export_hf(ckpt, out_dir=tmp_path / "hf", model=model_cfg, max_shard_bytes=512 * 1024)
    want = ref.state_dict()
    assert set(stored(out)) == set(want)  # the fused keys, none per expert
    loaded, info = _quiet_load(Qwen3OmniMoeThinkerForConditionalGeneration, out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    got = loaded.state_dict()
    assert not [k for k in want if not torch.equal(got[k], want[k])]


@pytest.mark.slow  # the full-model writers: ~5 s each on 2 cores; the thinker export stays fast
def test_export_from_a_full_model_rebuilds_it_with_talker_and_code2wav_untouched(tmp_path: Path) -> None:
    family = get_family("qwen3_omni")
    src = write_tiny_full_checkpoint(tmp_path / "src", seed=7)
    assert len(list(src.glob("model-*.safetensors"))) >= 2
    model_cfg = dataclasses.replace(family.tiny_model_config(), path=str(src))
    hf_config = family.hf_config_from_dir(src)
    torch.manual_seed(0)  # the "trained" thinker: not the source's (seed 7)
    ref = family.reference_model(hf_config).float()
    ckpt = checkpoint_of(family, hf_config, ref, tmp_path / "ckpts")
    out = export_hf(ckpt, out_dir=tmp_path / "hf", model=model_cfg, max_shard_bytes=256 * 1024)

    got = assert_rebuilt(src, out, carried=("talker.", "code2wav."))
    assert (out / "tokenizer_config.json").is_file()
    loaded, info = _quiet_load(Qwen3OmniMoeForConditionalGeneration, out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    want = ref.state_dict()
    thinker = loaded.thinker.state_dict()
    assert set(thinker) == set(want)
    assert not [k for k in want if not torch.equal(thinker[k], want[k])]
    key = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(got[f"thinker.{key}"], want[key])
    source = _quiet_load(Qwen3OmniMoeForConditionalGeneration, src)
    for part in ("talker", "code2wav"):
        a, b = getattr(loaded, part).state_dict(), getattr(source, part).state_dict()
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), part
    batch = hf_batch(hf_config)
    with torch.no_grad():
        assert torch.equal(loaded.thinker(**batch).logits, ref(**batch).logits)


@pytest.mark.slow  # the full-model writers: ~5 s each on 2 cores; the thinker export stays fast
def test_a_source_with_transposed_experts_gets_the_trained_experts_back_in_its_order(tmp_path: Path) -> None:
    """A full source storing the thinker's fused experts as transformers 4.57 did (``gate_up_proj``
    [E, H, 2I], ``down_proj`` [E, I, H]; dhp's loader transposes them, ``stored_dims``): the export
    writes the trained experts in that stored order. (transformers 5.25's
    ``Qwen3OmniMoeForConditionalGeneration`` loads neither that source nor its export: mismatched
    sizes; the export keeps the layout it was given.)"""
    family = get_family("qwen3_omni")
    src = write_tiny_full_checkpoint(tmp_path / "src", seed=7)
    experts = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
    for shard in src.glob("model-*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        flip = {k for k in tensors if k.startswith("thinker.") and k.endswith(experts)}
        if flip:
            tensors.update({k: tensors[k].transpose(1, 2).contiguous() for k in flip})
            save_file(tensors, str(shard), metadata={"format": "pt"})
    model_cfg = dataclasses.replace(family.tiny_model_config(), path=str(src))
    hf_config = family.hf_config_from_dir(src)
    torch.manual_seed(0)
    ref = family.reference_model(hf_config).float()
    ckpt = checkpoint_of(family, hf_config, ref, tmp_path / "ckpts")
    out = export_hf(ckpt, out_dir=tmp_path / "hf", model=model_cfg, max_shard_bytes=256 * 1024)
    got = assert_rebuilt(src, out, carried=("talker.", "code2wav."))
    want = ref.state_dict()
    key = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert want[key].shape[1] != want[key].shape[2]  # not square: the order is visible
    for name, t in got.items():
        if name.startswith("thinker.") and name.endswith(experts):
            assert torch.equal(t, want[name.removeprefix("thinker.")].transpose(1, 2)), name


def _release_name(key: str) -> str:
    """A full model's key as transformers 5 saves it -> the release's (``thinker.model.layers.*``,
    ``thinker.visual.*``, ``thinker.audio_tower.*``); the talker's and code2wav's are the same in both."""
    for new, old in (
        ("thinker.model.language_model.", "thinker.model."),
        ("thinker.model.visual.", "thinker.visual."),
        ("thinker.model.audio_tower.", "thinker.audio_tower."),
    ):
        if key.startswith(new):
            return old + key[len(new) :]
    return key


def _without(src: Path, out: Path, drop: set[str]) -> Path:
    """A copy of the HF directory ``src`` without the tensors ``drop`` (its shards and index rewritten)."""
    shutil.copytree(src, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for file in {index["weight_map"][k] for k in drop}:
        with safe_open(str(out / file), framework="pt") as f:
            kept = {k: f.get_tensor(k) for k in f.keys() if k not in drop}  # noqa: SIM118 (safe_open is no dict)
        save_file(kept, str(out / file), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in drop}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


@pytest.mark.slow  # the full-model writers: ~5 s each on 2 cores; the thinker export stays fast
def test_a_source_stored_per_expert_gets_the_trained_experts_back_per_expert(tmp_path: Path) -> None:
    """A full source in the release's layout: every MoE layer one tensor per expert, the thinker's and
    the talker's (``thinker.model.layers.{i}.mlp.experts.{j}.gate_proj.weight`` [I, H], ``up_proj``
    [I, H], ``down_proj`` [H, I]). The export has exactly the source's keys, the talker's experts as
    stored, and each trained fused expert tensor cut back into the source's per-expert keys (gate rows
    first, then up; torch.equal), in shards of at most ``max_shard_bytes`` of tensors. The full class
    loads it (transformers 5 fuses the experts on load) with the trained thinker's tensors and logits
    (fp32 on CPU: tolerance 0). A bf16 export casts the per-expert tensors and carries the rest as
    stored; a source lacking one of the trained experts is refused."""
    family = get_family("qwen3_omni")
    fused = write_tiny_full_checkpoint(tmp_path / "fused", seed=7)
    src = write_per_expert_copy(fused, tmp_path / "src", folds=family.expert_folds, rename=_release_name)
    model_cfg = dataclasses.replace(family.tiny_model_config(), path=str(src))
    hf_config = family.hf_config_from_dir(src)
    torch.manual_seed(0)  # the "trained" thinker: not the source's (seed 7)
    ref = family.reference_model(hf_config).float()
    ckpt = checkpoint_of(family, hf_config, ref, tmp_path / "ckpts")
    max_bytes = 256 * 1024
    out = export_hf(ckpt, out_dir=tmp_path / "hf", model=model_cfg, max_shard_bytes=max_bytes)

    got = assert_rebuilt(src, out, carried=("talker.", "code2wav."))
    assert any(k.startswith("talker.") and PER_EXPERT.search(k) for k in got)  # carried as stored
    assert not [k for k in got if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    want = ref.state_dict()
    t = hf_config.text_config
    inter = t.moe_intermediate_size
    assert inter != t.hidden_size  # not square: a transposed part could not pass
    moe = [
        i
        for i in range(t.num_hidden_layers)
        if f"model.language_model.layers.{i}.mlp.experts.down_proj" in want
    ]
    assert moe

    def assert_split(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        for layer in moe:
            gate_up = want[f"model.language_model.layers.{layer}.mlp.experts.gate_up_proj"].to(dtype)
            down = want[f"model.language_model.layers.{layer}.mlp.experts.down_proj"].to(dtype)
            for j in range(t.num_experts):
                key = f"thinker.model.layers.{layer}.mlp.experts.{j}"
                gate, up = tensors[f"{key}.gate_proj.weight"], tensors[f"{key}.up_proj.weight"]
                assert gate.dtype == up.dtype == dtype, key
                assert torch.equal(gate, gate_up[j, :inter]) and torch.equal(up, gate_up[j, inter:]), key
                assert not torch.equal(gate, up)  # gate and up swapped would fail the line above
                assert torch.equal(tensors[f"{key}.down_proj.weight"], down[j]), key

    assert_split(got, torch.float32)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for file in set(weight_map.values()):
        keys = [k for k, f in weight_map.items() if f == file]
        size = sum(got[k].numel() * got[k].element_size() for k in keys)
        assert size <= max_bytes or len(keys) == 1, (file, size)

    loaded, info = _quiet_load(Qwen3OmniMoeForConditionalGeneration, out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    thinker = loaded.thinker.state_dict()
    assert set(thinker) == set(want)
    assert not [k for k in want if not torch.equal(thinker[k], want[k])]
    batch = hf_batch(hf_config)
    with torch.no_grad():
        assert torch.equal(loaded.thinker(**batch).logits, ref(**batch).logits)

    cast = export_hf(ckpt, out_dir=tmp_path / "bf16", model=model_cfg, dtype=torch.bfloat16)
    assert_split(assert_rebuilt(src, cast, carried=("talker.", "code2wav.")), torch.bfloat16)

    last = f"thinker.model.layers.{moe[0]}.mlp.experts.{t.num_experts - 1}."
    lacking = _without(src, tmp_path / "lacking", {k for k in got if k.startswith(last)})
    with pytest.raises(CheckpointError, match=r"differ from its layout.*source shape \[\d+, "):
        export_hf(ckpt, out_dir=tmp_path / "refused", model=dataclasses.replace(model_cfg, path=str(lacking)))
