"""The tiny Qwen3-Omni thinker directory: the shared tiny parts (``dhp.models.tiny``: weights with the
experts fused as transformers 5 holds them, ``config.json``, the tiny tokenizer) plus what a released
directory holds beside them for training records with audio:

- the tokenizer with Qwen3-Omni's audio tokens (``<|audio_pad|>``, ``<|audio_start|>``,
  ``<|audio_end|>``) appended after the BPE vocab at ``conf/model/tiny_qwen3_omni.yaml``'s ids, and a
  chat template with audio parts (``<|audio_start|><|audio_pad|><|audio_end|>``);
- one ``preprocessor_config.json`` holding the image processor's settings (Qwen3's normalisation) and
  the audio feature extractor's (transformers' ``WhisperFeatureExtractor`` with the model's mel bins),
  as the released directory does, and ``video_preprocessor_config.json`` as Qwen3-VL's.

No ``processor_config.json``: the stock ``Qwen3OmniMoeProcessor`` needs torchvision to be built; dhp reads
the tokenizer, the image processor and the feature extractor on their own.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import Qwen2Tokenizer, WhisperFeatureExtractor

from dhp.config.schema import ModelConfig
from dhp.models.qwen3_base.tiny import QWEN3_CHAT_TEMPLATE, QWEN3_MEAN, QWEN3_STD, VIDEO_DEFAULTS
from dhp.models.qwen3_omni.family import OMNI_TOKEN_STRINGS
from dhp.models.tiny import SPECIAL_TOKENS, write_tiny_base

AUDIO_FIELDS = ("audio_token_id", "audio_start_token_id", "audio_end_token_id")
AUDIO_PART = "<|audio_start|><|audio_pad|><|audio_end|>"
# Qwen3-VL's reduced template with one more content part: each audio as audio-start, pad, audio-end
OMNI_CHAT_TEMPLATE = QWEN3_CHAT_TEMPLATE.replace(
    "{% elif content['type'] == 'video' or 'video' in content %}",
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    f"{AUDIO_PART}"
    "{% elif content['type'] == 'video' or 'video' in content %}",
)


def omni_tokenizer(tokenizer: Qwen2Tokenizer, model_cfg: ModelConfig) -> Qwen2Tokenizer:
    """The shared tiny tokenizer with the audio tokens at ``model_cfg.tokens``' ids and the chat
    template with audio parts; ValueError when those ids are not the ones after the BPE vocab."""
    vocab = dict(tokenizer.get_vocab())
    tok = model_cfg.tokens
    ids = [getattr(tok, f) for f in AUDIO_FIELDS]
    if ids != list(range(len(vocab), len(vocab) + 3)):
        raise ValueError(
            f"model.tokens audio ids {ids} must follow the tiny BPE vocab ({len(vocab)} tokens): "
            f"{len(vocab)}, {len(vocab) + 1}, {len(vocab) + 2}"
        )
    texts = [OMNI_TOKEN_STRINGS[f] for f in AUDIO_FIELDS]
    vocab.update(zip(texts, ids, strict=True))
    merges = [tuple(m) for m in json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]]
    out = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=[*SPECIAL_TOKENS[1:], *texts],
        model_max_length=4096,
    )
    out.chat_template = OMNI_CHAT_TEMPLATE
    got = {f: out.convert_tokens_to_ids(t) for f, t in OMNI_TOKEN_STRINGS.items()}
    want = {f: getattr(tok, f) for f in OMNI_TOKEN_STRINGS}
    if got != want:
        raise ValueError(f"tiny omni tokenizer ids {got} disagree with model.tokens {want}")
    return out


def write_tiny_checkpoint(
    out: Path, *, family: str, sharded: bool, seed: int, model_cfg: ModelConfig | None
) -> Path:
    """Write the tiny Qwen3-Omni thinker directory to ``out`` (``dhp.models.tiny.make_tiny_checkpoint``)."""
    model_cfg, tokenizer, image_processor = write_tiny_base(
        out, family=family, sharded=sharded, seed=seed, model_cfg=model_cfg, original_format=False
    )
    omni_tokenizer(tokenizer, model_cfg).save_pretrained(out)
    image_processor.image_mean, image_processor.image_std = list(QWEN3_MEAN), list(QWEN3_STD)
    features = WhisperFeatureExtractor(feature_size=model_cfg.audio.num_mel_bins)
    merged = {**features.to_dict(), **image_processor.to_dict()}
    (out / "preprocessor_config.json").write_text(json.dumps(merged, indent=2) + "\n", encoding="utf-8")
    v = model_cfg.vision
    video = {
        **VIDEO_DEFAULTS,
        "image_mean": list(QWEN3_MEAN),
        "image_std": list(QWEN3_STD),
        "merge_size": v.spatial_merge_size,
        "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size,
        "video_processor_type": "Qwen3VLVideoProcessor",
    }
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n", encoding="utf-8")
    return out
