"""The tiny Qwen2.5-VL directory: the shared tiny parts (``dhp.models.tiny``) plus the Qwen2.5-VL
processor (``processor_config.json`` naming ``Qwen2_5_VLProcessor``, Qwen's chat template)."""

from __future__ import annotations

import json
from pathlib import Path

from dhp.config.schema import ModelConfig
from dhp.models.qwen2_5_vl.processor import QWEN_CHAT_TEMPLATE, Qwen2_5_VLImageTextProcessor
from dhp.models.tiny import write_tiny_base


def write_tiny_checkpoint(
    out: Path, *, family: str, sharded: bool, seed: int, model_cfg: ModelConfig | None
) -> Path:
    """Write the tiny Qwen2.5-VL directory to ``out`` (see ``dhp.models.tiny.make_tiny_checkpoint``)."""
    _, tokenizer, image_processor = write_tiny_base(
        out, family=family, sharded=sharded, seed=seed, model_cfg=model_cfg
    )
    processor = Qwen2_5_VLImageTextProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN_CHAT_TEMPLATE
    )
    processor.save_pretrained(out)
    image_processor.save_pretrained(out)  # preprocessor_config.json, for tools that read it alone
    # A standard HF directory: AutoProcessor resolves the stock class (it needs torchvision for
    # its video part); dhp.models.qwen2_5_vl.load_processor needs nothing more than what is written here.
    for name in ("processor_config.json", "tokenizer_config.json", "preprocessor_config.json"):
        cfg_file = out / name
        cfg = json.loads(cfg_file.read_text())
        if "processor_class" in cfg:
            cfg["processor_class"] = "Qwen2_5_VLProcessor"
            cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
    return out
