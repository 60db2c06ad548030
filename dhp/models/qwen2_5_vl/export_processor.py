"""An export's processor that ``AutoProcessor`` loads where torchvision does not import.

transformers' ``Qwen2_5_VLProcessor`` owns a video processor that requires torchvision; beside the
CPU torch wheel dhp pins, torchvision does not import, so ``AutoProcessor.from_pretrained(export)``
fails there. When that is the case at export time, the export's processor configs name
``Qwen2_5_VLImageTextProcessor`` (the same tokenizer, image processor, chat template and
``<|image_pad|>`` expansion, without the video part, as ``dhp.models.qwen2_5_vl.load_processor`` uses) and
carry its code as ``processing_dhp_image_text.py`` with an ``auto_map``, so
``AutoProcessor.from_pretrained(export, trust_remote_code=True)`` loads it with transformers alone.
Where torchvision imports, the stock class is kept (it adds video).
"""

from __future__ import annotations

import json
from pathlib import Path

REMOTE_MODULE = "processing_dhp_image_text"
IMAGE_TEXT_CLASS = "Qwen2_5_VLImageTextProcessor"
#: stock processor class -> its image+text stand-in
STAND_INS = {"Qwen2_5_VLProcessor": IMAGE_TEXT_CLASS}
CONFIG_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")

_CODE = '''"""Qwen2.5-VL's processor without its video part: loads without torchvision (written by dhp export)."""

from transformers import Qwen2_5_VLProcessor


class Qwen2_5_VLImageTextProcessor(Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` with only ``image_processor`` and ``tokenizer`` (no video processor)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
            **kwargs,
        )
'''


def torchvision_imports() -> bool:
    """True when ``import torchvision`` works in this environment (a broken wheel raises on import)."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # ImportError, or RuntimeError "operator torchvision::nms does not exist"
        return False
    return True


def make_processor_loadable(out_dir: Path, *, force: bool = False) -> bool:
    """Point ``out_dir``'s processor configs at the image+text processor when torchvision does not
    import (or ``force``); returns True when the configs were rewritten."""
    if not force and torchvision_imports():
        return False
    changed = False
    for name in CONFIG_FILES:
        path = out_dir / name
        if not path.is_file():
            continue
        cfg = json.loads(path.read_text(encoding="utf-8"))
        stand_in = STAND_INS.get(cfg.get("processor_class", ""))  # a JSON file, not a config tree
        if stand_in is None:
            continue
        cfg["processor_class"] = stand_in
        cfg.setdefault("auto_map", {})["AutoProcessor"] = f"{REMOTE_MODULE}.{stand_in}"
        path.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        changed = True
    if changed:
        (out_dir / f"{REMOTE_MODULE}.py").write_text(_CODE, encoding="utf-8")
    return changed
