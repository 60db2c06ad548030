"""Qwen3.5 architecture numbers <-> the transformers ``Qwen3_5Config`` / ``Qwen3_5MoeConfig`` (both
directions; the MoE config is the dense one's hybrid LLM with the router, experts and shared expert)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import Qwen3_5Config, Qwen3_5MoeConfig

from dhp.errors import CheckpointError
from dhp.models.qwen3_5.arch import Numbers
from dhp.models.qwen3_vision.config import vision_config_kwargs, vision_numbers_from_hf


def _mlp_kwargs(n: Numbers) -> dict[str, object]:
    """The dense SwiGLU width, or the MoE block's numbers (the shared expert is ``n.mlp`` wide;
    ``output_router_logits`` stays transformers' default false: the LLM module asks for the logits)."""
    if not n.moe:
        return {"intermediate_size": n.mlp}
    return {
        "num_experts": n.experts,
        "num_experts_per_tok": n.top_k,
        "moe_intermediate_size": n.moe_mlp,
        "shared_expert_intermediate_size": n.mlp,
        "router_aux_loss_coef": n.aux_coef,
    }


def build_hf_config(
    n: Numbers, *, tokens: Mapping[str, int], dtype: torch.dtype, attn_implementation: str
) -> Qwen3_5Config | Qwen3_5MoeConfig:
    """The transformers config of validated numbers (the merger projects to the LLM hidden size):
    ``Qwen3_5MoeConfig`` when the numbers declare experts, else ``Qwen3_5Config``."""
    cls, arch = (
        (Qwen3_5MoeConfig, "Qwen3_5MoeForConditionalGeneration")
        if n.moe
        else (Qwen3_5Config, "Qwen3_5ForConditionalGeneration")
    )
    return cls(
        architectures=[arch],  # config.json names the class that loads it
        vision_config=vision_config_kwargs(n.vision, deepstack=False),
        text_config=dict(
            vocab_size=n.vocab,
            hidden_size=n.hidden,
            num_hidden_layers=n.layers,
            layer_types=list(n.layer_types),
            num_attention_heads=n.heads,
            num_key_value_heads=n.kv_heads,
            head_dim=n.head_dim,
            hidden_act=n.llm_act,
            **_mlp_kwargs(n),
            rms_norm_eps=n.rms_norm_eps,
            max_position_embeddings=n.max_position_embeddings,
            linear_num_key_heads=n.linear_k_heads,
            linear_num_value_heads=n.linear_v_heads,
            linear_key_head_dim=n.linear_k_dim,
            linear_value_head_dim=n.linear_v_dim,
            linear_conv_kernel_dim=n.conv_kernel,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": n.rope_theta,
                "partial_rotary_factor": n.partial_rotary_factor,
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


def numbers_from_hf(cfg: Qwen3_5Config | Qwen3_5MoeConfig) -> Numbers:
    """The numbers of a transformers config (a HF directory's ``config.json``)."""
    v, t = cfg.vision_config, cfg.text_config
    rope = t.rope_parameters
    if "partial_rotary_factor" not in rope:
        raise CheckpointError(
            f"text_config.rope_parameters {rope} has no partial_rotary_factor. Fix: load the config through "
            f"transformers' Qwen3_5Config, which sets it."
        )
    moe = t.num_experts if isinstance(cfg, Qwen3_5MoeConfig) else 0
    mlp = t.shared_expert_intermediate_size if moe else t.intermediate_size
    return Numbers(
        vision=vision_numbers_from_hf(v, deepstack=False),
        hidden=t.hidden_size,
        layer_types=tuple(t.layer_types),
        heads=t.num_attention_heads,
        kv_heads=t.num_key_value_heads,
        head_dim=t.head_dim,
        mlp=mlp,
        vocab=t.vocab_size,
        tied=bool(cfg.tie_word_embeddings),
        llm_act=t.hidden_act,
        mrope_section=tuple(rope["mrope_section"]),
        mrope_interleaved=bool(rope["mrope_interleaved"]) if "mrope_interleaved" in rope else True,
        partial_rotary_factor=float(rope["partial_rotary_factor"]),
        rope_theta=float(rope["rope_theta"]),
        rms_norm_eps=float(t.rms_norm_eps),
        max_position_embeddings=t.max_position_embeddings,
        linear_k_heads=t.linear_num_key_heads,
        linear_v_heads=t.linear_num_value_heads,
        linear_k_dim=t.linear_key_head_dim,
        linear_v_dim=t.linear_value_head_dim,
        conv_kernel=t.linear_conv_kernel_dim,
        experts=moe,
        top_k=t.num_experts_per_tok if moe else 0,
        moe_mlp=t.moe_intermediate_size if moe else 0,
        aux_coef=float(t.router_aux_loss_coef) if moe else 0.0,
    )
