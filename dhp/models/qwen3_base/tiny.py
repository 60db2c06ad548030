"""The tiny directory of a Qwen3-style family (Qwen3-VL and Qwen3.5, dense and MoE): the shared tiny
parts (``dhp.models.tiny``: weights, ``config.json``, the tiny tokenizer) plus what a released Qwen3-VL
or Qwen3.5 directory holds beside them, so ``dhp train conf=tiny_qwen3_vl data.path=my.jsonl`` reads it
as it would read a downloaded one (the MoE experts fused, as transformers 5 holds and loads them):

- ``preprocessor_config.json``: the Qwen2-VL image processor at the family's patch 16, merge 2 and
  temporal patch 2, with Qwen3's normalisation (mean = std = 0.5 per channel, as released);
- ``video_preprocessor_config.json``: ``Qwen3VLVideoProcessor``'s settings at the same geometry (that
  class needs torchvision to be built, so the file is written from its declared defaults);
- the tokenizer files with :data:`QWEN3_CHAT_TEMPLATE` (``chat_template.jinja``) and
  ``processor_config.json`` naming the stock ``Qwen3VLProcessor``, which ``AutoProcessor`` loads where
  torchvision imports. dhp itself reads the tokenizer (``AutoTokenizer``) and the image processor
  (``Qwen2VLImageProcessorPil``) and decodes videos on its own (``dhp.data.video``).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import Qwen3VLProcessor

from dhp.config.schema import ModelConfig
from dhp.models.tiny import write_tiny_base

#: Qwen3-VL's chat template reduced to what training records use: a leading system turn, user and
#: assistant turns, image and video parts. Unlike Qwen2.5-VL's there is no default system prompt.
QWEN3_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n"
    "{% if messages[0]['content'] is string %}{{ messages[0]['content'] }}"
    "{% else %}{% for content in messages[0]['content'] %}"
    "{% if 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' or message['role'] == 'assistant' %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN3_MEAN = QWEN3_STD = (0.5, 0.5, 0.5)  # the released Qwen3-VL / Qwen3.5 image and video processors'
PROCESSOR_CLASS = "Qwen3VLProcessor"  # what Qwen3-VL, Qwen3-VL-MoE and Qwen3.5(-MoE) directories name
# Qwen3VLVideoProcessor's declared defaults (transformers 5.x), at the model's geometry below
VIDEO_DEFAULTS = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "do_sample_frames": True,
    "fps": 2,
    "max_frames": 768,
    "min_frames": 4,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": 32 * 32 * 768, "shortest_edge": 128 * 32 * 32},
}


class _ImageTextProcessor(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` without its video processor, only to write the processor's files here
    (the stock class cannot be built without torchvision); the files name the stock class."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
        super().__init__(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
            **kwargs,
        )


def write_tiny_checkpoint(
    out: Path, *, family: str, sharded: bool, seed: int, model_cfg: ModelConfig | None
) -> Path:
    """Write the tiny directory of Qwen3-style ``family`` to ``out`` (``dhp.models.tiny.make_tiny_checkpoint``)."""
    # the fused experts as transformers 5 holds (and loads) them: Qwen3.5-MoE's release stores one
    # tensor per expert, which dhp's loader folds too (dhp.models.tiny.write_per_expert_copy writes it)
    model_cfg, tokenizer, image_processor = write_tiny_base(
        out, family=family, sharded=sharded, seed=seed, model_cfg=model_cfg, original_format=False
    )
    image_processor.image_mean, image_processor.image_std = list(QWEN3_MEAN), list(QWEN3_STD)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    processor = _ImageTextProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN3_CHAT_TEMPLATE
    )
    processor.save_pretrained(out)
    image_processor.save_pretrained(out)  # preprocessor_config.json, as released directories have it
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = out / name
        cfg = json.loads(path.read_text())
        if "processor_class" in cfg or name != "tokenizer_config.json":  # the stock class, as released
            cfg["processor_class"] = PROCESSOR_CLASS
            path.write_text(json.dumps(cfg, indent=2) + "\n")
    v = model_cfg.vision
    video = {
        **VIDEO_DEFAULTS,
        "image_mean": list(QWEN3_MEAN),
        "image_std": list(QWEN3_STD),
        "merge_size": v.spatial_merge_size,
        "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size,
        "processor_class": PROCESSOR_CLASS,
        "video_processor_type": "Qwen3VLVideoProcessor",
    }
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    return out
