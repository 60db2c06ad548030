"""Qwen3-VL-MoE architecture numbers <-> the transformers ``Qwen3VLMoeConfig`` (both directions)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import Qwen3VLMoeConfig

from dhp.models.qwen3_vision.config import vision_config_kwargs, vision_numbers_from_hf
from dhp.models.qwen3_vl_moe.arch import Numbers


def build_hf_config(
    n: Numbers, *, tokens: Mapping[str, int], dtype: torch.dtype, attn_implementation: str
) -> Qwen3VLMoeConfig:
    """The transformers config of validated numbers (every merger projects to the LLM hidden size).

    ``output_router_logits`` stays transformers' default (false, as released): the family's LLM module
    asks the text model for the router logits itself, and the reference is called with it set.
    """
    return Qwen3VLMoeConfig(
        architectures=["Qwen3VLMoeForConditionalGeneration"],  # config.json names the class that loads it
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
            num_experts=n.experts,
            num_experts_per_tok=n.top_k,
            moe_intermediate_size=n.moe_mlp,
            decoder_sparse_step=n.sparse_step,
            mlp_only_layers=list(n.mlp_only),
            router_aux_loss_coef=n.aux_coef,
            norm_topk_prob=n.norm_topk_prob,  # as released; transformers' router always renormalises
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


def numbers_from_hf(cfg: Qwen3VLMoeConfig) -> Numbers:
    """The numbers of a transformers config (a HF directory's ``config.json``).

    ``norm_topk_prob`` is true whatever the file says: it is what transformers' router computes.
    """
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
        experts=t.num_experts,
        top_k=t.num_experts_per_tok,
        moe_mlp=t.moe_intermediate_size,
        sparse_step=t.decoder_sparse_step,
        mlp_only=tuple(t.mlp_only_layers),
        aux_coef=float(t.router_aux_loss_coef),
        norm_topk_prob=True,
    )
