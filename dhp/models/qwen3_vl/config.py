"""Qwen3-VL architecture numbers <-> the transformers ``Qwen3VLConfig`` (both directions)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import Qwen3VLConfig

from dhp.models.qwen3_vision.config import vision_config_kwargs, vision_numbers_from_hf
from dhp.models.qwen3_vl.arch import Numbers


def build_hf_config(
    n: Numbers, *, tokens: Mapping[str, int], dtype: torch.dtype, attn_implementation: str
) -> Qwen3VLConfig:
    """The transformers config of validated numbers (every merger projects to the LLM hidden size)."""
    return Qwen3VLConfig(
        architectures=["Qwen3VLForConditionalGeneration"],  # config.json names the class that loads it
        vision_config=vision_config_kwargs(n.vision, deepstack=True),
        text_config=dict(
            vocab_size=n.vocab,
            hidden_size=n.hidden,
            num_hidden_layers=n.layers,
            num_attention_heads=n.heads,
            num_key_value_heads=n.kv_heads,
            head_dim=n.head_dim,
            hidden_act=n.llm_act,
            intermediate_size=n.mlp,
            rms_norm_eps=n.rms_norm_eps,
            max_position_embeddings=n.max_position_embeddings,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": n.rope_theta,
                "mrope_section": list(n.mrope_section),
                "mrope_interleaved": n.mrope_interleaved,
            },
            bos_token_id=tokens["bos_token_id"],
            eos_token_id=tokens["eos_token_id"],
            pad_token_id=tokens["pad_token_id"],
        ),
        image_token_id=tokens["image_token_id"],
        video_token_id=tokens["video_token_id"],
        vision_start_token_id=tokens["vision_start_token_id"],
        vision_end_token_id=tokens["vision_end_token_id"],
        tie_word_embeddings=n.tied,
        attn_implementation=attn_implementation,
        dtype=dtype,
    )


def numbers_from_hf(cfg: Qwen3VLConfig) -> Numbers:
    """The numbers of a transformers config (a HF directory's ``config.json``)."""
    v, t = cfg.vision_config, cfg.text_config
    rope = t.rope_parameters
    return Numbers(
        vision=vision_numbers_from_hf(v, deepstack=True),
        hidden=t.hidden_size,
        layers=t.num_hidden_layers,
        heads=t.num_attention_heads,
        kv_heads=t.num_key_value_heads,
        head_dim=t.head_dim,
        mlp=t.intermediate_size,
        vocab=t.vocab_size,
        tied=bool(cfg.tie_word_embeddings),
        llm_act=t.hidden_act,
        mrope_section=tuple(rope["mrope_section"]),
        mrope_interleaved=bool(rope["mrope_interleaved"]) if "mrope_interleaved" in rope else True,
        rope_theta=float(rope["rope_theta"]),
        rms_norm_eps=float(t.rms_norm_eps),
        max_position_embeddings=t.max_position_embeddings,
    )
