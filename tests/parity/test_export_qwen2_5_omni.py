"""A dhp checkpoint of the three Qwen2.5-Omni modules -> HF directory (``dhp.checkpoint.export``).

Thinker-only source (no ``model.path``): transformers' ``Qwen2_5OmniThinkerForConditionalGeneration``
loads the export with every tensor and the logits of an audio + image batch bit-equal to the model the
modules came from.

Full source (``model.path`` a sharded ``Qwen2_5OmniForConditionalGeneration`` directory: ``thinker.*``,
``talker.*``, ``token2wav.*``): the export has the source's keys and config; its talker and token2wav
tensors are the source's bytes; its thinker tensors are the trained ones (a thinker other than the
source's), and ``Qwen2_5OmniForConditionalGeneration.from_pretrained`` loads it with no key missing or
unexpected (every loaded weight is the trained thinker's or the source model's), its thinker's logits bit-equal to the trained thinker's. All fp32 on CPU: tolerance 0.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
from export_checks import assert_rebuilt, checkpoint_of
from omegaconf import OmegaConf
from omni_batch import omni_batch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniThinkerForConditionalGeneration

from dhp.checkpoint import (
    CheckpointMeta,
    ModuleRecord,
    begin_checkpoint,
    commit_checkpoint,
    save_module_state,
)
from dhp.checkpoint.export import export_hf
from dhp.config.schema import LoraConfig
from dhp.errors import CheckpointError
from dhp.models import get_family
from dhp.models.qwen2_5_omni.tiny import tiny_full_config, write_tiny_full_checkpoint
from dhp.parallel.lora import apply_lora

pytestmark = [pytest.mark.parity, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
RECORDS = [[("text", 3), ("image", (4, 4)), ("audio", 41)], [("text", 6), ("audio", 17)]]


def test_export_of_the_three_modules_loads_in_transformers_with_equal_logits(tmp_path: Path) -> None:
    family = get_family("qwen2_5_omni")
    model_cfg = family.tiny_model_config()
    hf_config = family.hf_config(model_cfg)
    torch.manual_seed(0)
    ref = family.reference_model(hf_config)
    ckpt = checkpoint_of(family, hf_config, ref, tmp_path / "ckpts")
    out = export_hf(ckpt, out_dir=tmp_path / "hf", model=model_cfg, max_shard_bytes=512 * 1024)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    want = ref.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    assert not [k for k in want if not torch.equal(got[k], want[k])]
    batch = omni_batch(hf_config, RECORDS, seeds=[1, 2])["hf"]
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, ref(**batch).logits)


@pytest.mark.slow  # the full-model writers: ~5 s each on 2 cores; the thinker export stays fast
def test_export_from_a_full_model_rebuilds_it_with_talker_and_token2wav_untouched(tmp_path: Path) -> None:
    family = get_family("qwen2_5_omni")
    src = write_tiny_full_checkpoint(tmp_path / "src", seed=7)
    assert len(list(src.glob("model-*.safetensors"))) >= 2
    model_cfg = dataclasses.replace(family.tiny_model_config(), path=str(src))
    hf_config = family.hf_config_from_dir(src)
    torch.manual_seed(0)  # the "trained" thinker: not the source's (seed 7)
    ref = family.reference_model(hf_config)
    ckpt = checkpoint_of(family, hf_config, ref, tmp_path / "ckpts")
    out = export_hf(ckpt, out_dir=tmp_path / "hf", model=model_cfg, max_shard_bytes=256 * 1024)

    got = assert_rebuilt(src, out, carried=("talker.", "token2wav."))
    # streamed: no output shard holds more than max_shard_bytes of tensors, unless one tensor alone
    for shard in out.glob("model-*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]  # noqa: SIM118 (safe_open is no dict)
        assert sum(sizes) <= 256 * 1024 or len(sizes) == 1, shard.name
    assert (out / "spk_dict.pt").is_file() and (out / "tokenizer_config.json").is_file()
    # the thinker is the trained one, under the source's (released) names
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # (its from_pretrained cannot return the loading info: it reads spk_dict.pt after loading)
        loaded = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    want = ref.state_dict()
    thinker = loaded.thinker.state_dict()
    assert set(thinker) == set(want)
    assert not [k for k in want if not torch.equal(thinker[k], want[k])]
    assert torch.equal(
        got["thinker.model.embed_tokens.weight"], want["model.language_model.embed_tokens.weight"]
    )
    # every talker and token2wav weight transformers loaded is the source model's (none left at init)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        source = Qwen2_5OmniForConditionalGeneration(tiny_full_config(family.tiny_model_config()))
    for part in ("talker", "token2wav"):
        a, b = getattr(loaded, part).state_dict(), getattr(source, part).state_dict()
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), part
    batch = omni_batch(hf_config, RECORDS, seeds=[1, 2])["hf"]
    with torch.no_grad():
        assert torch.equal(loaded.thinker(**batch).logits, ref(**batch).logits)


@pytest.mark.slow  # the full-model writers: ~5 s each on 2 cores; the thinker export stays fast
def test_a_cast_export_casts_the_thinker_only_and_a_stray_source_key_is_refused(tmp_path: Path) -> None:
    """``dtype=bfloat16``: the thinker tensors are cast, the talker's and token2wav's keep their fp32
    bytes. A source tensor that belongs to no module (the rebuilt model would lack it) is an error."""
    family = get_family("qwen2_5_omni")
    src = write_tiny_full_checkpoint(tmp_path / "src", seed=7)
    model_cfg = dataclasses.replace(family.tiny_model_config(), path=str(src))
    hf_config = family.hf_config_from_dir(src)
    torch.manual_seed(0)
    ckpt = checkpoint_of(family, hf_config, family.reference_model(hf_config), tmp_path / "ckpts")
    out = export_hf(ckpt, out_dir=tmp_path / "bf16", model=model_cfg, dtype=torch.bfloat16)
    got = assert_rebuilt(src, out, carried=("talker.", "token2wav."))
    assert {t.dtype for k, t in got.items() if k.startswith("thinker.")} == {torch.bfloat16}
    assert {t.dtype for k, t in got.items() if not k.startswith("thinker.")} == {torch.float32}

    save_file({"speaker_table.weight": torch.zeros(2)}, str(src / "extra.safetensors"))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["speaker_table.weight"] = "extra.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"speaker_table\.weight"):
        export_hf(ckpt, out_dir=tmp_path / "stray", model=model_cfg)


@pytest.mark.slow  # the full-model writers: ~5 s each on 2 cores; the thinker export stays fast
def test_lora_adapters_merge_into_the_rebuilt_thinker_and_adapter_files_are_refused(tmp_path: Path) -> None:
    """A LoRA run from a full source: ``merge`` writes each adapted weight as W + (alpha / r) B A under
    the source's name (computed here by hand from the trained module, fp32: within 1e-6 absolute, one
    matmul); ``adapter`` (peft files named for another model's module paths) is a CheckpointError.
    The source here is one ``model.safetensors`` (no index)."""
    family = get_family("qwen2_5_omni")
    src = write_tiny_full_checkpoint(tmp_path / "src", seed=7, max_shard_size="50GB")
    assert (src / "model.safetensors").is_file() and not (src / "model.safetensors.index.json").exists()
    model_cfg = dataclasses.replace(family.tiny_model_config(), path=str(src))
    hf_config = family.hf_config_from_dir(src)
    lora = OmegaConf.structured(
        LoraConfig(rank=2, alpha=4.0, targets=["language_model.layers.*.self_attn.q_proj"])
    )
    torch.manual_seed(0)
    modules = {
        name: family.build_module(name, hf_config, device="cpu", dtype=torch.float32)
        for name in family.module_names
    }
    modules["llm"] = apply_lora(modules["llm"], module_name="llm", lora=lora)
    with torch.no_grad():
        for n, p in modules["llm"].named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05)  # as after training (B starts at zero)
    tmp = begin_checkpoint(tmp_path / "ckpts", step=1)
    for name, module in modules.items():
        save_module_state(tmp / name, model=module, optimizer=None)
    meta = CheckpointMeta(
        step=1, data_state={}, driver_rng={}, plan={"groups": []}, config_hash="c", model_hash="m",
        modules={n: ModuleRecord(1, False, False) for n in modules},
    )  # fmt: skip
    ckpt = commit_checkpoint(tmp, meta=meta, keep_last=1)
    configs = {"audio": LoraConfig(rank=0), "vision": LoraConfig(rank=0), "llm": lora}
    out = export_hf(ckpt, out_dir=tmp_path / "hf", model=model_cfg, lora=configs, lora_mode="merge")
    got = assert_rebuilt(src, out, carried=("talker.", "token2wav."))
    params = dict(modules["llm"].named_parameters())
    layer = "language_model.layers.1.self_attn.q_proj"
    a, b = params[f"{layer}.lora_A.default.weight"], params[f"{layer}.lora_B.default.weight"]
    want = params[f"{layer}.base_layer.weight"] + (4.0 / 2) * (b @ a)
    assert (got["thinker.model.layers.1.self_attn.q_proj.weight"] - want).abs().max() <= 1e-6
    with pytest.raises(CheckpointError, match="--lora merge"):
        export_hf(ckpt, out_dir=tmp_path / "adapter", model=model_cfg, lora=configs, lora_mode="adapter")
