"""A Qwen3-style decoder's numbers <-> transformers' ``text_config`` names, for every Qwen3-style family.

Torch-free: it reads and writes plain keyword dicts and config attributes; the family passes the
transformers config class (``Qwen3VLConfig``, ``Qwen3_5MoeConfig``, ...) it builds from them. The family
adds its own keys (:meth:`Qwen3Family.text_config`, its ``numbers_from_hf``).
"""

from __future__ import annotations

from typing import Any

from dhp.models.common import decoder_config
from dhp.models.qwen3_base.arch import TextNumbers
from dhp.models.qwen3_vision.config import vision_numbers_from_hf


def text_config(n: TextNumbers, **rope: Any) -> dict[str, Any]:
    """The ``text_config`` keywords every Qwen3 decoder has (``rope``: the family's extra rotary keys,
    e.g. ``partial_rotary_factor``); the MoE flavour's router numbers when it has experts. The MLP
    widths and the family's other sizes are the family's."""
    kwargs = decoder_config(
        vocab=n.vocab,
        hidden=n.hidden,
        layers=n.layers,
        heads=n.heads,
        kv_heads=n.kv_heads,
        rms_norm_eps=n.rms_norm_eps,
        max_position_embeddings=n.max_position_embeddings,
        rope_theta=n.rope_theta,
        **rope,
        mrope_section=list(n.mrope_section),
        mrope_interleaved=n.mrope_interleaved,
    )
    kwargs.update(head_dim=n.head_dim, hidden_act=n.llm_act)
    if n.moe:
        kwargs.update(
            num_experts=n.experts,
            num_experts_per_tok=n.top_k,
            moe_intermediate_size=n.moe_mlp,
            router_aux_loss_coef=n.aux_coef,
        )
    return kwargs


def text_numbers_from_hf(cfg: Any, *, deepstack: bool, moe: bool) -> dict[str, Any]:
    """The :class:`TextNumbers` fields of a transformers config but ``mlp``, which the family reads (the
    dense width or a shared expert's). An absent ``mrope_interleaved`` is transformers' default for
    these models: interleaved."""
    t = cfg.text_config
    rope = t.rope_parameters
    out: dict[str, Any] = dict(
        vision=vision_numbers_from_hf(cfg.vision_config, deepstack=deepstack),
        hidden=t.hidden_size,
        heads=t.num_attention_heads,
        kv_heads=t.num_key_value_heads,
        head_dim=t.head_dim,
        vocab=t.vocab_size,
        tied=bool(cfg.tie_word_embeddings),
        llm_act=t.hidden_act,
        mrope_section=tuple(rope["mrope_section"]),
        mrope_interleaved=bool(rope["mrope_interleaved"]) if "mrope_interleaved" in rope else True,
        rope_theta=float(rope["rope_theta"]),
        rms_norm_eps=float(t.rms_norm_eps),
        max_position_embeddings=t.max_position_embeddings,
    )
    if moe:
        out.update(
            experts=t.num_experts,
            top_k=t.num_experts_per_tok,
            moe_mlp=t.moe_intermediate_size,
            aux_coef=float(t.router_aux_loss_coef),
        )
    return out
