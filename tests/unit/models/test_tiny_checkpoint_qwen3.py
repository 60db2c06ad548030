"""Every tiny recipe's model has a tiny checkpoint that real data reads: the Qwen3-style families' (Qwen3-VL,
Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE) hold the files a released directory of the family holds, each loadable
by transformers' own ``from_pretrained``, and dhp's data path reads their tokenizer (with the chat template)
and image processor."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

from dhp.config.schema import DataConfig
from dhp.data.processing import load_image_processor, load_tokenizer
from dhp.models import TINY_TOKENS, get_family, make_tiny_checkpoint
from dhp.models.qwen3_base.tiny import QWEN3_CHAT_TEMPLATE
from dhp.models.tiny import tiny_writer

pytestmark = pytest.mark.unit
CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
#: conf/model tiny entry -> the model_type its config.json must carry
TINY = {
    "tiny_qwen3_vl": "qwen3_vl",
    "tiny_qwen3_vl_moe": "qwen3_vl_moe",
    "tiny_qwen3_5": "qwen3_5",
    "tiny_qwen3_5_moe": "qwen3_5_moe",
}
#: what a released Qwen3-VL / Qwen3.5 directory holds beside its weights (tokenizer files as
#: transformers 5 saves them)
RELEASED = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name in TINY:
        cfg = OmegaConf.load(CONF / f"{name}.yaml")
        out[name] = make_tiny_checkpoint(tmp_path_factory.mktemp(name), model_cfg=cfg)
    return out


def test_every_tiny_model_config_has_its_tiny_checkpoint():
    for name in ("tiny", *TINY):
        cfg = OmegaConf.load(CONF / f"{name}.yaml")
        assert cfg.tiny is True and cfg.path is None, name  # real data reads the cached checkpoint
    assert tiny_writer("qwen3_vl").__module__ == "dhp.models.qwen3_base.tiny"
    assert tiny_writer("qwen3_5").__module__ == "dhp.models.qwen3_base.tiny"
    assert tiny_writer("qwen2_5_vl").__module__ == "dhp.models.qwen2_5_vl.tiny"


@pytest.mark.parametrize("name", list(TINY))
def test_the_released_layout_loads_with_transformers(dirs, name):
    path = dirs[name]
    assert {p.name for p in path.iterdir()} == RELEASED
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == TINY[name]
    model = getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) > 0
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert tok.chat_template == QWEN3_CHAT_TEMPLATE
    assert tok.convert_tokens_to_ids("<|image_pad|>") == TINY_TOKENS.image_token_id
    image = AutoImageProcessor.from_pretrained(path)
    v = config.vision_config
    assert (image.patch_size, image.merge_size) == (v.patch_size, v.spatial_merge_size)
    assert list(image.image_mean) == [0.5, 0.5, 0.5] == list(image.image_std)  # Qwen3's, as released
    video = json.loads((path / "video_preprocessor_config.json").read_text())
    assert video["video_processor_type"] == "Qwen3VLVideoProcessor" and video["patch_size"] == v.patch_size
    for f in ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json"):
        assert json.loads((path / f).read_text())["processor_class"] == "Qwen3VLProcessor", f


def test_the_chat_template_renders_turns_as_qwen3_does(dirs):
    tok = AutoTokenizer.from_pretrained(dirs["tiny_qwen3_vl"], local_files_only=True)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the picture."}]},
        {"role": "assistant", "content": "A cat sits on a red sofa."},
    ]
    assert tok.apply_chat_template(messages, tokenize=False) == (  # no default system prompt
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the picture.<|im_end|>\n"
        "<|im_start|>assistant\nA cat sits on a red sofa.<|im_end|>\n"
    )
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(system, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("name", ["tiny_qwen3_vl", "tiny_qwen3_5_moe"])
def test_dhp_reads_the_tokenizer_processor_and_weights(dirs, name):
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    family = get_family(cfg.family)
    load_tokenizer(str(dirs[name]), tokens=cfg.tokens, family=cfg.family)  # ids checked against model.tokens
    proc = load_image_processor(str(dirs[name]), data=DataConfig(max_pixels=16384), family=cfg.family)
    assert proc.get_number_of_image_patches(512, 512) == 64  # 128x128 px of 16 px patches
    from dhp.models.loading import build_and_load

    hf_config = family.hf_config_from_dir(dirs[name])
    for module in family.module_names:  # the MoE experts are stored fused, as dhp reads them
        build_and_load(family, module, dirs[name], hf_config=hf_config, dtype=torch.float32, device="cpu")


@pytest.mark.skipif(not HAS_TORCHVISION, reason="transformers' Qwen3-VL video processor needs torchvision")
def test_auto_processor_loads_where_torchvision_exists(dirs):
    from transformers import AutoProcessor

    assert type(AutoProcessor.from_pretrained(dirs["tiny_qwen3_vl"])).__name__ == "Qwen3VLProcessor"
