"""A tiny, complete Qwen3.5 HF directory for tests, made offline in about a second.

``make_tiny_checkpoint(out_dir, family="qwen3_5")`` (``dhp.models.tiny``) writes what a released
Qwen3.5 directory holds for training: ``config.json`` (model_type ``qwen3_5``), ``model.safetensors``
(transformers' own random init of the tiny architecture: Gated DeltaNet and gated attention layers),
the tiny byte-level BPE tokenizer (Qwen's special tokens first, the ids of
``conf/model/tiny_qwen3_5.yaml``) and ``preprocessor_config.json`` with patch 16.
"""

from __future__ import annotations

from pathlib import Path

from dhp.config.schema import ModelConfig
from dhp.models.tiny import make_tiny_checkpoint, write_tiny_base


def write_tiny_checkpoint(out: Path, *, sharded: bool, seed: int, model_cfg: ModelConfig | None) -> Path:
    """The shared tiny parts only: Qwen3.5 needs no processor file of its own for training."""
    _, tokenizer, image_processor = write_tiny_base(
        out, family="qwen3_5", sharded=sharded, seed=seed, model_cfg=model_cfg
    )
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    return out


def make_tiny_qwen3_5_checkpoint(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny Qwen3.5 directory to ``out_dir`` (the caller's RNG is left untouched)."""
    return make_tiny_checkpoint(out_dir, family="qwen3_5", seed=seed)
