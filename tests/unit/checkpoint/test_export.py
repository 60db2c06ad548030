"""DCP checkpoint -> HF directory: ``Qwen2_5_VLForConditionalGeneration.from_pretrained`` loads it exactly."""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from dhp.checkpoint import (
    CheckpointMeta,
    ModuleRecord,
    begin_checkpoint,
    commit_checkpoint,
    save_module_state,
)
from dhp.checkpoint.export import export_hf
from dhp.config.schema import ModelConfig
from dhp.errors import CheckpointError
from dhp.models import get_family

pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _checkpoint(root: Path, model_cfg: ModelConfig) -> tuple[Path, dict[str, torch.nn.Module]]:
    family = get_family(model_cfg.family)
    hf = family.hf_config(model_cfg)
    torch.manual_seed(0)
    mods = {n: family.build_module(n, hf, device="cpu", dtype=torch.float32) for n in family.module_names}
    tmp = begin_checkpoint(root, step=7)
    for name, m in mods.items():
        opt = None if name == "vision" else torch.optim.AdamW(m.parameters())  # vision saved frozen
        save_module_state(tmp / name, model=m, optimizer=opt)
    meta = CheckpointMeta(
        step=7,
        data_state={},
        driver_rng={},
        plan={"groups": []},
        config_hash="c",
        model_hash="m",
        modules={"vision": ModuleRecord(1, True, False), "llm": ModuleRecord(1, False, True)},
    )
    return commit_checkpoint(tmp, meta=meta, keep_last=1), mods


def _assert_loads_exactly(out: Path, mods: dict[str, torch.nn.Module], dtype: torch.dtype) -> None:
    family = get_family("qwen2_5_vl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(out), dtype=dtype)
    split = family.split_state_dict(ref.state_dict())
    for name, m in mods.items():
        sd = m.state_dict()
        assert set(sd) == set(split[name])
        bad = [k for k in sd if not torch.equal(sd[k].to(dtype), split[name][k])]
        assert not bad, f"{name}: exported tensors differ: {bad[:5]}"


def test_export_sharded_fp32_roundtrips_exactly(tmp_path: Path) -> None:
    model_cfg = get_family("qwen2_5_vl").tiny_model_config()
    ckpt, mods = _checkpoint(tmp_path / "ckpts", model_cfg)
    out = export_hf(ckpt, out_dir=tmp_path / "hf", model=model_cfg, max_shard_bytes=256 * 1024)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1  # the shard limit was honoured
    assert (out / "config.json").is_file()
    _assert_loads_exactly(out, mods, torch.float32)


def test_export_bf16_and_tied_embeddings(tmp_path: Path) -> None:
    model_cfg = copy.deepcopy(get_family("qwen2_5_vl").tiny_model_config())
    model_cfg.llm.tie_word_embeddings = True
    ckpt, mods = _checkpoint(tmp_path / "ckpts", model_cfg)
    out = export_hf(ckpt, out_dir=tmp_path / "hf", model=model_cfg, dtype=torch.bfloat16)
    _assert_loads_exactly(out, mods, torch.bfloat16)


def test_export_under_other_architecture_is_refused(tmp_path: Path) -> None:
    model_cfg = get_family("qwen2_5_vl").tiny_model_config()
    ckpt, _ = _checkpoint(tmp_path / "ckpts", model_cfg)
    other = copy.deepcopy(model_cfg)
    other.llm.num_layers = 3
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint"):
        export_hf(ckpt, out_dir=tmp_path / "hf", model=other)


@pytest.mark.slow
def test_cli_export_reads_the_run_config(tmp_path: Path) -> None:
    import subprocess
    import sys

    from omegaconf import OmegaConf

    from dhp.validation import load_config

    cfg = load_config("tiny_vlm", [])
    run = tmp_path / "runs" / "tiny_vlm" / "20260101-000000"
    ckpt, mods = _checkpoint(run / "checkpoints", get_family("qwen2_5_vl").tiny_model_config())
    cli = [sys.executable, "-m", "dhp.cli", "export", str(run), str(tmp_path / "hf")]
    proc = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "config.yaml" in proc.stderr  # no run config yet: typed error
    missing = subprocess.run([*cli[:4], str(tmp_path / "nope"), str(tmp_path / "hf")], capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert missing.returncode == 2 and "dhp export CHECKPOINT" in missing.stderr, missing.stderr
    assert "train.resume" not in missing.stderr  # the command's own argument, not train's
    OmegaConf.save(cfg, run / "config.yaml")
    proc = subprocess.run([*cli, "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ckpt.name in proc.stdout.replace("\n", "")
    assert "Qwen2_5_VLForConditionalGeneration.from_pretrained" in proc.stdout.replace("\n", "")
    _assert_loads_exactly(tmp_path / "hf", mods, torch.float32)
    # the group that serves the model can read it (safetensors alone writes its shards 0600)
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir() if p.is_file()}
    assert modes and set(modes.values()) == {0o666 & ~mask}, modes


def test_export_with_model_path_copies_tokenizer_and_processor(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from dhp.models.tiny import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "src")
    model_cfg = copy.deepcopy(get_family("qwen2_5_vl").tiny_model_config())
    model_cfg.path = str(src)
    ckpt, mods = _checkpoint(tmp_path / "ckpts", model_cfg)
    out = export_hf(ckpt, out_dir=tmp_path / "hf", model=model_cfg)
    copied = {p.name for p in src.iterdir() if not p.name.startswith("model") and p.name != "config.json"}
    assert copied and copied <= {p.name for p in out.iterdir()}
    _assert_loads_exactly(out, mods, torch.float32)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.decode(tok("a cat")["input_ids"]).strip() == "a cat"
    # AutoProcessor loads the export here, where torchvision does not import beside the CPU torch
    # (dhp.models.qwen2_5_vl.export_processor), and one real photo runs through it and the model class
    from PIL import Image
    from transformers import AutoProcessor

    from dhp.models.qwen2_5_vl import load_processor

    photo = sorted((Path(__file__).parents[3] / "dhp" / "data_assets" / "demo" / "images").glob("*.*"))[0]
    image = Image.open(photo).convert("RGB")
    proc = AutoProcessor.from_pretrained(str(out), trust_remote_code=True)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    inputs = proc(images=[image], text=[text], return_tensors="pt")
    ours = load_processor(out)(images=[image], text=[text], return_tensors="pt")
    assert torch.equal(inputs["input_ids"], ours["input_ids"])  # the same expansion as dhp's processor
    assert torch.equal(inputs["pixel_values"], ours["pixel_values"])
    assert int((inputs["input_ids"] == model_cfg.tokens.image_token_id).sum()) > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(out)).eval()
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[:2] == inputs["input_ids"].shape and torch.isfinite(logits).all()
