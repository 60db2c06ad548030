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

:func:`write_tiny_full_checkpoint` writes the same files around a full
``Qwen3OmniMoeForConditionalGeneration`` (``qwen3_omni_moe``: the tiny thinker, a tiny MoE talker with
its code predictor, and a tiny code2wav; random weights), sharded, the experts fused as transformers 5
holds them (``thinker.model.language_model.*``, ``talker.*``, ``code2wav.*``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Qwen2Tokenizer, WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig

from dhp.config.schema import ModelConfig
from dhp.models import get_family
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


#: the tiny speech output: a 2-layer MoE talker (4 experts, top 2) with a 1-layer code predictor over 4
#: code groups, and a 1-layer code2wav with two upsampling stages
TINY_TALKER_TEXT = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
TINY_CODE_PREDICTOR = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_code_groups=4,
)
TINY_CODE2WAV = dict(
    codebook_size=64,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=64,
    num_hidden_layers=1,
    num_quantizers=4,
    upsample_rates=[2, 2],
    upsampling_ratios=[2],
    decoder_dim=32,
    sliding_window=8,
)


def tiny_full_config(model_cfg: ModelConfig) -> Qwen3OmniMoeConfig:
    """The full model's config: ``model_cfg``'s thinker, the tiny talker (the thinker's token ids and
    width; codec ids at the top of its 64-entry vocabulary) and the tiny code2wav."""
    thinker = get_family("qwen3_omni").hf_config(model_cfg)
    tok = model_cfg.tokens
    talker = dict(
        text_config=TINY_TALKER_TEXT,
        code_predictor_config=TINY_CODE_PREDICTOR,
        num_code_groups=TINY_CODE_PREDICTOR["num_code_groups"],
        thinker_hidden_size=thinker.text_config.hidden_size,
        accept_hidden_layer=1,
        spatial_merge_size=thinker.vision_config.spatial_merge_size,
        codec_eos_token_id=60,
        codec_nothink_id=59,
        codec_think_bos_id=58,
        codec_think_eos_id=57,
        codec_pad_id=56,
        codec_bos_id=55,
        audio_token_id=tok.audio_token_id,
        image_token_id=tok.image_token_id,
        video_token_id=tok.video_token_id,
        vision_start_token_id=tok.vision_start_token_id,
        audio_start_token_id=tok.audio_start_token_id,
    )
    return Qwen3OmniMoeConfig(
        thinker_config=thinker.to_dict(),
        talker_config=talker,
        code2wav_config=TINY_CODE2WAV,
        enable_audio_output=True,
        architectures=["Qwen3OmniMoeForConditionalGeneration"],
    )


def write_tiny_full_checkpoint(
    out: Path, *, seed: int = 0, model_cfg: ModelConfig | None = None, max_shard_size: str = "300KB"
) -> Path:
    """Write a tiny full Qwen3-Omni directory to ``out``: the thinker directory's tokenizer and
    processor files, the full model's ``config.json`` and its random weights (transformers' init under
    ``seed``; the caller's RNG untouched) saved by ``save_pretrained`` in ``max_shard_size`` shards
    plus the index, the experts fused (``save_original_format=False``, as transformers 5 holds them;
    the release's one tensor per expert, which the loader and the export read as well, is
    ``dhp.models.tiny.write_per_expert_copy`` of this directory)."""
    # reason: transformers' model code costs seconds to import; only a test writing a full model needs it
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model_cfg = model_cfg if model_cfg is not None else get_family("qwen3_omni").tiny_model_config()
    write_tiny_checkpoint(out, family="qwen3_omni", sharded=False, seed=seed, model_cfg=model_cfg)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3OmniMoeForConditionalGeneration(tiny_full_config(model_cfg))
        # transformers 5.25's init leaves the talker's fused experts as allocated (torch.empty):
        # drawn here as its other linear weights are, so the directory is the same on every run
        std = model.config.talker_config.initializer_range
        with torch.no_grad():
            for name, param in model.talker.named_parameters():
                if ".mlp.experts." in name:
                    param.normal_(0.0, std)
    model.save_pretrained(out, max_shard_size=max_shard_size, save_original_format=False)
    return out
