"""A tiny, complete Qwen3-VL-MoE HF directory for tests, made offline in about a second.

``make_tiny_checkpoint(out_dir, family="qwen3_vl_moe")`` (``dhp.models.tiny``) writes what a released
Qwen3-VL-MoE directory holds for training: ``config.json`` (model_type ``qwen3_vl_moe``),
``model.safetensors`` (transformers' own random init of the tiny architecture, experts as 3-D
tensors), the tiny byte-level BPE tokenizer (Qwen's special tokens first, the ids of
``conf/model/tiny_qwen3_vl_moe.yaml``) and ``preprocessor_config.json`` with patch 16.
:func:`released_expert_layout` rewrites its experts as the released checkpoints store them.
"""

from __future__ import annotations

from pathlib import Path

from dhp.config.schema import ModelConfig
from dhp.models.tiny import make_tiny_checkpoint, write_tiny_base


def write_tiny_checkpoint(out: Path, *, sharded: bool, seed: int, model_cfg: ModelConfig | None) -> Path:
    """The shared tiny parts only: Qwen3-VL-MoE needs no processor file of its own for training."""
    _, tokenizer, image_processor = write_tiny_base(
        out, family="qwen3_vl_moe", sharded=sharded, seed=seed, model_cfg=model_cfg
    )
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    return out


def make_tiny_qwen3_vl_moe_checkpoint(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny Qwen3-VL-MoE directory to ``out_dir`` (the caller's RNG is left untouched)."""
    return make_tiny_checkpoint(out_dir, family="qwen3_vl_moe", seed=seed)


def released_expert_layout(out_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Rewrite a directory's expert tensors in the released checkpoints' layout (``gate_up_proj``
    [E, H, 2I], ``down_proj`` [E, I, H], as transformers 4.57 wrote them; transformers 5 and dhp hold
    [E, 2I, H] / [E, H, I]), in place; returns ``{key: new shape}``. For loader tests."""
    # deferred: only loader tests rewrite a directory; importing the tiny module stays light
    from safetensors.torch import load_file, save_file

    shapes = {}
    for f in sorted(Path(out_dir).glob("*.safetensors")):
        tensors = load_file(str(f))
        for key in [k for k in tensors if ".mlp.experts." in k]:
            tensors[key] = tensors[key].transpose(1, 2).contiguous()
            shapes[key] = tuple(tensors[key].shape)
        save_file(tensors, str(f), metadata={"format": "pt"})
    return shapes
