"""The tiny Qwen2.5-Omni thinker directory: the shared tiny parts (``dhp.models.tiny``) with
Qwen2.5-Omni's token texts, its chat template, and one ``preprocessor_config.json`` holding both the
image processor's and the audio feature extractor's settings, as the released directories do.

The shared tiny tokenizer names Qwen2.5-VL's specials (``<|image_pad|>`` at 12, ...); this one names
the same ids as Qwen2.5-Omni's tokenizer does (``<|IMAGE|>``, ``<|VIDEO|>``, ``<|vision_bos|>``,
``<|vision_eos|>``) and appends ``<|AUDIO|>``, ``<|audio_bos|>``, ``<|audio_eos|>`` after the BPE vocab
(``conf/model/tiny_qwen2_5_omni.yaml`` ``tokens``). The audio features are transformers'
``WhisperFeatureExtractor`` with the model's ``num_mel_bins`` (128: the real extractor).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import Qwen2Tokenizer, WhisperFeatureExtractor

from dhp.config.schema import ModelConfig
from dhp.models.qwen2_5_omni.family import OMNI_TOKEN_STRINGS
from dhp.models.tiny import SPECIAL_TOKENS, write_tiny_base

#: the shared tiny tokenizer's text -> Qwen2.5-Omni's, for the same ids
RENAMED = {
    "<|image_pad|>": "<|IMAGE|>",
    "<|video_pad|>": "<|VIDEO|>",
    "<|vision_start|>": "<|vision_bos|>",
    "<|vision_end|>": "<|vision_eos|>",
}
AUDIO_TOKENS = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")

# Qwen2.5-Omni's ChatML: each image <|vision_bos|><|IMAGE|><|vision_eos|>, each video
# <|vision_bos|><|VIDEO|><|vision_eos|>, each audio <|audio_bos|><|AUDIO|><|audio_eos|>, a system turn
# added when the conversation has none; every turn's text is a prefix of the next (the loss mask needs it)
OMNI_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def omni_tokenizer(tokenizer: Qwen2Tokenizer, model_cfg: ModelConfig) -> Qwen2Tokenizer:
    """The shared tiny tokenizer with Qwen2.5-Omni's token texts and the audio tokens at
    ``model_cfg.tokens``' ids; ValueError when those ids are not the ones after the BPE vocab."""
    vocab = {RENAMED.get(t, t): i for t, i in tokenizer.get_vocab().items()}
    tok = model_cfg.tokens
    audio_ids = (tok.audio_token_id, tok.audio_start_token_id, tok.audio_end_token_id)
    if list(audio_ids) != list(range(len(vocab), len(vocab) + 3)):
        raise ValueError(
            f"model.tokens audio ids {audio_ids} must follow the tiny BPE vocab ({len(vocab)} tokens): "
            f"{len(vocab)}, {len(vocab) + 1}, {len(vocab) + 2}"
        )
    vocab.update(zip(AUDIO_TOKENS, audio_ids, strict=True))
    merges = [tuple(m) for m in json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]]
    specials = [RENAMED.get(t, t) for t in SPECIAL_TOKENS[1:]] + list(AUDIO_TOKENS)
    out = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=specials,
        model_max_length=4096,
    )
    out.chat_template = OMNI_CHAT_TEMPLATE
    got = {field: out.convert_tokens_to_ids(text) for field, text in OMNI_TOKEN_STRINGS.items()}
    want = {field: getattr(tok, field) for field in OMNI_TOKEN_STRINGS}
    if got != want:
        raise ValueError(f"tiny omni tokenizer ids {got} disagree with model.tokens {want}")
    return out


def write_tiny_checkpoint(
    out: Path, *, family: str, sharded: bool, seed: int, model_cfg: ModelConfig | None
) -> Path:
    """Write the tiny Qwen2.5-Omni thinker directory to ``out`` (``dhp.models.tiny.make_tiny_checkpoint``)."""
    model_cfg, tokenizer, image_processor = write_tiny_base(
        out, family=family, sharded=sharded, seed=seed, model_cfg=model_cfg
    )
    omni_tokenizer(tokenizer, model_cfg).save_pretrained(out)
    features = WhisperFeatureExtractor(feature_size=model_cfg.audio.num_mel_bins)
    merged = {**features.to_dict(), **image_processor.to_dict()}
    (out / "preprocessor_config.json").write_text(json.dumps(merged, indent=2) + "\n", encoding="utf-8")
    return out
