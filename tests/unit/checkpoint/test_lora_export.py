"""LoRA export: a checkpoint of modules with peft LoRA layers -> a merged HF directory (transformers
loads it) and peft's adapter format (peft loads it onto the exported base); both give the logits of
the trained LoRA model (the unsplit model with the same peft layers and weights) within 1e-5 (fp32:
merging reorders one matmul)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

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
from dhp.parallel.lora import apply_lora, inject_reference_lora

pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

LORA = {
    "vision": OmegaConf.structured(LoraConfig(rank=2, alpha=4.0, targets=["visual.blocks.*.attn.qkv"])),
    "llm": OmegaConf.structured(
        LoraConfig(
            rank=4,
            alpha=8.0,
            targets=["language_model.layers.*.self_attn.q_proj", "language_model.layers.*.mlp.down_proj"],
        )
    ),
}


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    """Modules with LoRA on both (B made non-zero, as after training), saved as a dhp checkpoint."""
    root = tmp_path_factory.mktemp("lora")
    family = get_family("qwen2_5_vl")
    model_cfg = family.tiny_model_config()
    hf = family.hf_config(model_cfg)
    torch.manual_seed(0)
    mods = {}
    for name in family.module_names:
        m = apply_lora(
            family.build_module(name, hf, device="cpu", dtype=torch.float32),
            module_name=name,
            lora=LORA[name],
        )
        with torch.no_grad():
            for n, p in m.named_parameters():
                if ".lora_B." in n:
                    p.normal_(0, 0.05)
        mods[name] = m
    tmp = begin_checkpoint(root / "ckpts", step=3)
    for name, m in mods.items():
        save_module_state(tmp / name, model=m, optimizer=None)
    meta = CheckpointMeta(
        step=3, data_state={}, driver_rng={}, plan={"groups": []}, config_hash="c", model_hash="m",
        modules={n: ModuleRecord(1, False, False) for n in mods},
    )  # fmt: skip
    return commit_checkpoint(tmp, meta=meta, keep_last=1), mods, model_cfg, hf, root


def _inputs(hf):
    v = hf.vision_config
    grid = torch.tensor([[1, 4, 4]])
    pixels = torch.randn(
        16,
        v.in_channels * v.temporal_patch_size * v.patch_size**2,
        generator=torch.Generator().manual_seed(1),
    )
    ids = torch.tensor(
        [[5, 6, hf.vision_start_token_id] + [hf.image_token_id] * 4 + [hf.vision_end_token_id, 9, 10, 11]]
    )
    types = (ids == hf.image_token_id).long()
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        pixel_values=pixels,
        image_grid_thw=grid,
        mm_token_type_ids=types,
    )


def _logits(model, hf) -> torch.Tensor:
    with torch.no_grad():
        return model(**_inputs(hf), use_cache=False).logits


def _trained_reference(mods, hf):
    """The unsplit model with the same peft LoRA layers, filled with the checkpoint's tensors."""
    family = get_family("qwen2_5_vl")
    ref = family.reference_model(hf)
    owner = {}
    for key, t in ref.state_dict().items():
        for module, sub in family.split_state_dict({key: t}).items():
            for fqn in sub:
                owner[key] = (module, fqn)
    inject_reference_lora(ref, owner, modules={n: OmegaConf.create({"lora": c}) for n, c in LORA.items()})
    sd = {k: mods[m].state_dict()[f] for k, (m, f) in owner.items() if f in mods[m].state_dict()}
    missing = ref.load_state_dict(sd, strict=False).missing_keys
    assert not [k for k in missing if "lora" in k or "base_layer" in k], missing
    return ref.eval()


def test_lora_export_merge_and_adapter_give_the_trained_logits(lora_checkpoint):
    from peft import PeftModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    ckpt, mods, model_cfg, hf, root = lora_checkpoint
    want = _logits(_trained_reference(mods, hf), hf)
    merged_dir = export_hf(ckpt, out_dir=root / "merged", model=model_cfg, lora=LORA, lora_mode="merge")
    adapter_dir = export_hf(ckpt, out_dir=root / "adapter", model=model_cfg, lora=LORA, lora_mode="adapter")
    assert (
        not (merged_dir / "adapter").exists() and (adapter_dir / "adapter" / "adapter_config.json").is_file()
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(merged_dir)).eval()
        base = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(adapter_dir)).eval()
        base_logits = _logits(base, hf)
        peft_model = PeftModel.from_pretrained(base, str(adapter_dir / "adapter")).eval()
        got_merged, got_adapter = _logits(merged, hf), _logits(peft_model, hf)
        # transformers itself loads the adapter folder (base from base_model_name_or_path) with peft installed
        got_hf = _logits(
            Qwen2_5_VLForConditionalGeneration.from_pretrained(str(adapter_dir / "adapter")).eval(), hf
        )
    assert (base_logits - want).abs().max() > 1e-3  # the adapters matter: the base alone is off
    assert torch.allclose(got_merged, want, atol=1e-5, rtol=0), (got_merged - want).abs().max()
    assert torch.allclose(got_adapter, want, atol=1e-5, rtol=0), (got_adapter - want).abs().max()
    assert torch.allclose(got_hf, want, atol=1e-5, rtol=0), (got_hf - want).abs().max()


def test_lora_checkpoint_without_lora_config_is_a_checkpoint_error(lora_checkpoint, tmp_path: Path):
    ckpt, _, model_cfg, _, _ = lora_checkpoint
    with pytest.raises(CheckpointError, match="LoRA adapters"):
        export_hf(ckpt, out_dir=tmp_path / "x", model=model_cfg)
    with pytest.raises(CheckpointError, match=r"export\.lora"):
        export_hf(ckpt, out_dir=tmp_path / "y", model=model_cfg, lora=LORA, lora_mode="fold")


def test_adapter_base_path_is_configurable_and_relative_loads(lora_checkpoint, monkeypatch):
    """``--adapter-base ..``: the adapter names its base relative to itself, so the export moves."""
    import json
    import shutil

    from transformers import Qwen2_5_VLForConditionalGeneration

    ckpt, mods, model_cfg, hf, root = lora_checkpoint
    out = export_hf(
        ckpt, out_dir=root / "rel", model=model_cfg, lora=LORA, lora_mode="adapter", adapter_base=".."
    )
    conf = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == ".."
    moved = shutil.move(str(out), str(root / "moved"))  # the export dir moved elsewhere
    monkeypatch.chdir(Path(moved) / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _logits(Qwen2_5_VLForConditionalGeneration.from_pretrained(".").eval(), hf)
    want = _logits(_trained_reference(mods, hf), hf)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
