"""A tiny, complete Qwen3-VL HF directory for tests, made offline in about a second.

``make_tiny_qwen3_vl_checkpoint(out_dir)`` writes what a released Qwen3-VL directory holds for training:
``config.json`` (model_type ``qwen3_vl``), ``model.safetensors`` (transformers' own random init of the tiny
architecture), the tiny byte-level BPE tokenizer of ``dhp.models.tiny`` (Qwen's special tokens first, the
ids of ``conf/model/tiny_qwen3_vl.yaml``) and ``preprocessor_config.json`` with patch 16.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from dhp.models.qwen3_vl.family import Qwen3VLFamily
from dhp.models.tiny import TINY_MAX_PIXELS, TINY_MIN_PIXELS, train_tiny_tokenizer


def make_tiny_qwen3_vl_checkpoint(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny Qwen3-VL directory to ``out_dir`` (the caller's RNG is left untouched)."""
    family = Qwen3VLFamily()
    model_cfg = family.tiny_model_config()
    hf_config = family.hf_config(model_cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = family.reference_model(hf_config)
    model.save_pretrained(out)
    train_tiny_tokenizer(vocab_size=model_cfg.llm.vocab_size).save_pretrained(out)
    Qwen2VLImageProcessorPil(
        patch_size=model_cfg.vision.patch_size,
        merge_size=model_cfg.vision.spatial_merge_size,
        temporal_patch_size=model_cfg.vision.temporal_patch_size,
        min_pixels=TINY_MIN_PIXELS,
        max_pixels=TINY_MAX_PIXELS,
    ).save_pretrained(out)
    return out
