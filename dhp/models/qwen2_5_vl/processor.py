"""The Qwen2.5-VL processor for images and text, loadable without torchvision.

transformers' ``Qwen2_5_VLProcessor`` also owns a video processor, and in transformers 5.x that
class requires torchvision. The CPU torch wheel used for development has no matching torchvision
(the PyPI build fails to import: ``operator torchvision::nms does not exist``), so
``AutoProcessor.from_pretrained`` fails there. :class:`Qwen2_5_VLImageTextProcessor` is the same
processor minus the video part: the same tokenizer, the same image processor (the PIL backend
``Qwen2VLImageProcessorPil`` when torchvision is absent), the same chat template, the same
``<|image_pad|>`` expansion and ``mm_token_type_ids``. Videos are rejected by the model anyway.
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen2_5_VLProcessor

from dhp.models.chat_templates import QWEN2_VL

QWEN_CHAT_TEMPLATE = QWEN2_VL  # Qwen2.5-VL's own (dhp.models.chat_templates names it qwen2_vl)


class Qwen2_5_VLImageTextProcessor(Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` with only ``image_processor`` and ``tokenizer`` (no video processor)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
        super().__init__(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
            **kwargs,
        )


def load_processor(path: str | Path) -> Qwen2_5_VLImageTextProcessor:
    """The image+text processor of a local HF directory (offline; no torchvision needed).

    The directory stays a standard HF directory: where torchvision is installed,
    ``AutoProcessor.from_pretrained(path)`` gives the full ``Qwen2_5_VLProcessor`` with the same
    text and image behaviour.
    """
    return Qwen2_5_VLImageTextProcessor.from_pretrained(str(path), local_files_only=True)
