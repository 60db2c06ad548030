"""The tiny HF directory: complete, loadable offline, tokenizer ids agree with the model config."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

from dhp.models import TINY_TOKENS, get_family
from dhp.models.qwen2_5_vl import load_processor
from dhp.models.testing import modules_from_reference, reference_step
from dhp.models.tiny import SPECIAL_TOKENS

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[3]
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def _real_image() -> Image.Image:
    import skimage

    return Image.open(Path(skimage.__file__).parent / "data" / "astronaut.png").convert("RGB")


def test_directory_is_complete(tiny_dir, tiny_sharded_dir):
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "preprocessor_config.json",
        "processor_config.json",
    ):
        assert (tiny_dir / name).is_file(), name
        assert (tiny_sharded_dir / name).is_file(), name
    assert (tiny_dir / "model.safetensors").is_file()
    index = json.loads((tiny_sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert not (tiny_sharded_dir / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tiny_dir).model_type == "qwen2_5_vl"
    for f in tiny_dir.glob("*.json"):  # a standard HF directory: only stock transformers class names
        assert "ImageTextProcessor" not in f.read_text(), f.name


def test_same_seed_same_weights_and_sharding_does_not_change_them(tiny_dir, tiny_sharded_dir):
    from safetensors.torch import load_file

    single = load_file(str(tiny_dir / "model.safetensors"))
    index = json.loads((tiny_sharded_dir / "model.safetensors.index.json").read_text())["weight_map"]
    sharded = {}
    for f in sorted(set(index.values())):
        sharded.update(load_file(str(tiny_sharded_dir / f)))
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)


def test_tokenizer_loads_offline_with_qwen_special_tokens(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert ids == {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    assert ids["<|image_pad|>"] == TINY_TOKENS.image_token_id
    assert ids["<|vision_start|>"] == TINY_TOKENS.vision_start_token_id
    assert tok.eos_token_id == TINY_TOKENS.eos_token_id and tok.pad_token_id == TINY_TOKENS.pad_token_id
    assert len(tok) <= get_family("qwen2_5_vl").tiny_model_config().llm.vocab_size
    text = "An astronaut floats above the earth."
    assert tok.decode(tok(text).input_ids) == text
    enc = tok("<|vision_start|><|image_pad|><|image_pad|><|vision_end|>").input_ids
    assert enc == [9, 12, 12, 10]  # specials are never split


def test_chat_template_expands_images(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the picture."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat sits on a red sofa."}]},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the picture.<|im_end|>\n"
        "<|im_start|>assistant\nA cat sits on a red sofa.<|im_end|>\n"
    )


def test_processor_on_a_real_image_feeds_the_model(tiny_dir):
    assert type(AutoImageProcessor.from_pretrained(tiny_dir)).__name__.startswith("Qwen2VLImageProcessor")
    proc = load_processor(tiny_dir)
    image = _real_image().resize((200, 150))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = proc.apply_chat_template(messages, tokenize=False)
    out = proc(text=[text], images=[image], return_tensors="pt")
    grid = out["image_grid_thw"]
    assert grid.tolist() == [[1, 10, 14]]  # 150x200 px -> 140x196 -> 10x14 patches of 14 px
    assert out["pixel_values"].shape == (140, 3 * 2 * 14 * 14)
    n_image_tokens = int((out["input_ids"] == TINY_TOKENS.image_token_id).sum())
    assert n_image_tokens == 140 // 4 == int(out["mm_token_type_ids"].sum())

    family = get_family("qwen2_5_vl")
    hf_config = family.hf_config_from_dir(tiny_dir)
    from transformers import Qwen2_5_VLForConditionalGeneration

    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32)
    modules = modules_from_reference(family, ref, hf_config)
    batch = {
        **{
            k: out[k]
            for k in ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw")
        },
        "labels": out["input_ids"].masked_fill(out["mm_token_type_ids"] == 1, -100),
        "sample_ids": ["astronaut"],
    }
    ref_loss, _ = reference_step(ref, batch)
    with torch.no_grad():
        embeds = modules["vision"](batch["pixel_values"], batch["image_grid_thw"])["image_embeds"]
        kwargs = {k: v for k, v in batch.items() if k != "pixel_values"}
        llm_out = modules["llm"](**kwargs, image_embeds=embeds)
    # the chunked CE (dhp.ops) sums in another order than HF's loss: ~1e-7 relative
    torch.testing.assert_close(llm_out.loss_sum / llm_out.num_tokens, ref_loss, rtol=1e-6, atol=0)


@pytest.mark.skipif(not HAS_TORCHVISION, reason="transformers' Qwen2.5-VL video processor needs torchvision")
def test_auto_processor_loads_where_torchvision_exists(tiny_dir):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_dir, local_files_only=True)
    assert type(proc).__name__ == "Qwen2_5_VLProcessor"


@pytest.mark.slow
def test_script_writes_a_sharded_directory(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        str(REPO / "scripts/make_tiny_checkpoint.py"),
        "--out",
        str(tmp_path / "t"),
        "--sharded",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "t" / "model.safetensors.index.json").is_file()
    assert (tmp_path / "t" / "tokenizer.json").is_file()
