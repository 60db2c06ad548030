"""The tiny Qwen2.5-Omni thinker directory: the shared tiny parts (``dhp.models.tiny``) with
Qwen2.5-Omni's token texts, its chat template, and one ``preprocessor_config.json`` holding both the
image processor's and the audio feature extractor's settings, as the released directories do.

The shared tiny tokenizer names Qwen2.5-VL's specials (``<|image_pad|>`` at 12, ...); this one names
the same ids as Qwen2.5-Omni's tokenizer does (``<|IMAGE|>``, ``<|VIDEO|>``, ``<|vision_bos|>``,
``<|vision_eos|>``) and appends ``<|AUDIO|>``, ``<|audio_bos|>``, ``<|audio_eos|>`` after the BPE vocab
(``conf/model/tiny_qwen2_5_omni.yaml`` ``tokens``). The audio features are transformers'
``WhisperFeatureExtractor`` with the model's ``num_mel_bins`` (128: the real extractor).

:func:`write_tiny_full_checkpoint` writes the same files around a full ``Qwen2_5OmniForConditionalGeneration``
(``qwen2_5_omni``: the tiny thinker, a tiny talker and token2wav, random weights) in the released
layout (``thinker.*``, ``talker.*``, ``token2wav.*``), sharded, with a placeholder ``spk_dict.pt``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Qwen2_5OmniConfig, Qwen2Tokenizer, WhisperFeatureExtractor

from dhp.config.schema import ModelConfig
from dhp.models import get_family
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


#: the tiny speech output: a 2-layer talker (its codec vocabulary shares the thinker's size) and a
#: token2wav of a 2-block DiT and a 2-stage BigVGAN, as small as their code allows
TINY_TALKER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
)
TINY_DIT = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    head_dim=16,
    emb_dim=16,
    num_embeds=64,
    mel_dim=8,
    enc_emb_dim=8,
    enc_dim=8,
    enc_channels=[8, 8, 8, 8, 24],
    enc_attention_channels=8,
    enc_se_channels=8,
    look_ahead_layers=[1],
    look_backward_layers=[0],
)
TINY_BIGVGAN = dict(
    mel_dim=8,
    upsample_initial_channel=16,
    upsample_rates=[2, 2],
    upsample_kernel_sizes=[4, 4],
    resblock_kernel_sizes=[3],
    resblock_dilation_sizes=[[1, 3, 5]],
)


def tiny_full_config(model_cfg: ModelConfig) -> Qwen2_5OmniConfig:
    """The full model's config: ``model_cfg``'s thinker, :data:`TINY_TALKER` (the thinker's token ids,
    codec and TTS ids at the top of its vocabulary) and the tiny token2wav."""
    thinker = get_family("qwen2_5_omni").hf_config(model_cfg)
    vocab, tok = model_cfg.llm.vocab_size, model_cfg.tokens
    talker = TINY_TALKER | dict(
        vocab_size=vocab,
        embedding_size=thinker.text_config.hidden_size,
        audio_token_index=tok.audio_token_id,
        image_token_index=tok.image_token_id,
        video_token_index=tok.video_token_id,
        vision_start_token_id=tok.vision_start_token_id,
        vision_end_token_id=tok.vision_end_token_id,
        audio_start_token_id=tok.audio_start_token_id,
        audio_end_token_id=tok.audio_end_token_id,
        tts_text_start_token_id=vocab - 4,
        tts_text_end_token_id=vocab - 5,
        tts_text_pad_token_id=vocab - 6,
        tts_codec_start_token_id=vocab - 10,
        tts_codec_end_token_id=vocab - 9,
        tts_codec_pad_token_id=vocab - 8,
        tts_codec_mask_token_id=vocab - 7,
    )
    return Qwen2_5OmniConfig(
        thinker_config=thinker.to_dict(),
        talker_config=talker,
        token2wav_config=dict(dit_config=TINY_DIT, bigvgan_config=TINY_BIGVGAN),
        enable_audio_output=True,
        architectures=["Qwen2_5OmniForConditionalGeneration"],
    )


def write_tiny_full_checkpoint(
    out: Path, *, seed: int = 0, model_cfg: ModelConfig | None = None, max_shard_size: str = "200KB"
) -> Path:
    """Write a tiny full Qwen2.5-Omni directory to ``out``: the thinker directory's tokenizer and
    processor files, the full model's ``config.json`` and its random weights (transformers' init under
    ``seed``; the caller's RNG untouched) saved by ``save_pretrained`` in ``max_shard_size`` shards plus
    the index, and ``spk_dict.pt`` (one speaker of zeros: the full model's ``from_pretrained`` reads it)."""
    # reason: transformers' model code costs seconds to import; only a test writing a full model needs it
    from transformers import Qwen2_5OmniForConditionalGeneration

    model_cfg = model_cfg if model_cfg is not None else get_family("qwen2_5_omni").tiny_model_config()
    write_tiny_checkpoint(out, family="qwen2_5_omni", sharded=False, seed=seed, model_cfg=model_cfg)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    config = tiny_full_config(model_cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5OmniForConditionalGeneration(config)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    dit = config.token2wav_config.dit_config
    speaker = {
        "bos_token": config.talker_config.tts_codec_start_token_id,
        "cond": torch.zeros(1, dit.enc_emb_dim),
        "ref_mel": torch.zeros(1, 30, dit.mel_dim),
    }
    torch.save({"Chelsie": speaker}, out / "spk_dict.pt")
    return out
