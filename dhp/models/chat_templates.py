"""Named chat templates (``data.chat_template``): how a conversation becomes the text the model reads.

The default, ``checkpoint``, is ``model.path``'s own template (``chat_template.jinja``, or the
``chat_template`` of ``tokenizer_config.json``), as the model was trained with. A name here
overrides it, for a checkpoint without one or data written for another convention:

- ``qwen2_vl``: Qwen2-VL / Qwen2.5-VL's ChatML (``<|im_start|>role\\n...<|im_end|>``, each image
  ``<|vision_start|><|image_pad|><|vision_end|>``), a ``You are a helpful assistant.`` system turn
  added when the conversation has none;
- ``chatml``: the same ChatML without the added system turn: Qwen3-VL's and Qwen3.5's rendering of a
  conversation without tools or reasoning.

Any other value ending in ``.jinja`` is a file holding the template. Both named templates render each
turn's text as a prefix of the next, which the loss mask needs (``dhp.data.processing``). Torch-free.
"""

from __future__ import annotations

from pathlib import Path

_TURNS = (
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
)

QWEN2_VL = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}" + _TURNS + "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CHATML = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}" + _TURNS + "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CHAT_TEMPLATES = {"chatml": CHATML, "qwen2_vl": QWEN2_VL}
OWN = "checkpoint"  # data.chat_template: model.path's own template


def is_template_file(name: str) -> bool:
    """Whether ``data.chat_template`` names a template file rather than a template."""
    return name.endswith(".jinja")


def named_template(name: str) -> str | None:
    """The text of template ``name`` (a name above or a ``.jinja`` file); None for ``checkpoint``.
    KeyError for an unknown name, OSError for an unreadable file (validation reports both first)."""
    if name == OWN:
        return None
    if is_template_file(name):
        return Path(name).expanduser().read_text(encoding="utf-8")
    return CHAT_TEMPLATES[name]


def template_names() -> tuple[str, ...]:
    """Every value ``data.chat_template`` takes besides a ``.jinja`` path."""
    return (OWN, *CHAT_TEMPLATES)
