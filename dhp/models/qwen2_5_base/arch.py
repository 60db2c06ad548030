"""The Qwen2.5 decoder (GQA attention with q/k/v bias, SwiGLU MLP, RMSNorm, untied or tied lm_head)
without torch: parameter counts split by how TP shards them, the number checks, the typed blocks and
the parallel axes. Shared by Qwen2.5-VL and Qwen2.5-Omni's thinker (the same transformers layer
layout: ``layers.*.self_attn.{q,k,v,o}_proj``, ``layers.*.mlp.{gate,up,down}_proj``).

The counts follow transformers' modeling code exactly (a unit test instantiates the real model on
the meta device and compares). Embeddings and lm_head are vocab-parallel under TP.
"""

from __future__ import annotations

from omegaconf import DictConfig

from dhp.config.issues import Issues
from dhp.models.arch import (
    LLM_SIZES,
    Attention,
    Mlp,
    ModuleArch,
    ModuleAxes,
    ParamCount,
    decoder_axes,
    uniform_blocks,
)

#: the parameter globs TP shards (``Capabilities.tp_sharded["llm"]``)
LLM_TP_SHARDED = ("*.embed_tokens", "*.layers.*.self_attn.*_proj", "*.layers.*.mlp.*", "lm_head")


def llm_block_params(llm: DictConfig) -> ParamCount:
    """ONE decoder layer (an FSDP unit): RMSNorm x2, q h->h (+bias), k/v h->kv (+bias), o h->h (no
    bias), MLP gate/up h->m, down m->h (no bias)."""
    h, m = llm.hidden_size, llm.intermediate_size
    kv = llm.num_kv_heads * (h // llm.num_heads)
    return ParamCount(tp_sharded=(h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * m, replicated=2 * h)


def llm_params(llm: DictConfig) -> ParamCount:
    """Language model incl. embeddings, final norm and lm_head (unless tied)."""
    layer = llm_block_params(llm)
    embeddings = llm.vocab_size * llm.hidden_size * (1 if llm.tie_word_embeddings else 2)
    return ParamCount(
        tp_sharded=llm.num_layers * layer.tp_sharded + embeddings,
        replicated=llm.num_layers * layer.replicated + llm.hidden_size,
    )


def llm_largest_param(llm: DictConfig) -> int:
    """Elements of the decoder's largest single parameter tensor (before TP/FSDP sharding)."""
    return max(llm.vocab_size * llm.hidden_size, llm.hidden_size * llm.intermediate_size)


def validate_llm_arch(lm: DictConfig, issues: Issues) -> None:
    """Issues for every number of ``model.llm`` the decoder cannot build (incl. ``extra.mrope_section``)."""
    issues.positive(lm, "model.llm", list(LLM_SIZES))
    if lm.num_heads > 0 and lm.num_kv_heads > 0:
        ok_h = issues.check(
            lm.hidden_size % lm.num_heads == 0,
            "model.llm.hidden_size",
            lm.hidden_size,
            f"must be divisible by model.llm.num_heads={lm.num_heads}",
            "pick a head count that divides the hidden size",
        )
        issues.check(
            lm.num_heads % lm.num_kv_heads == 0,
            "model.llm.num_kv_heads",
            lm.num_kv_heads,
            f"must divide model.llm.num_heads={lm.num_heads} (grouped-query attention)",
            "pick a KV head count that divides the head count",
        )
        if ok_h and "extra" in lm and "mrope_section" in lm.extra:
            half = lm.hidden_size // lm.num_heads // 2
            issues.check(
                sum(lm.extra["mrope_section"]) == half,
                "model.llm.extra.mrope_section",
                list(lm.extra["mrope_section"]),
                f"must sum to head_dim/2 = {half}",
                "use the published [16, 24, 24] for head_dim 128",
            )


def llm_arch(model: DictConfig, *, inputs: tuple[str, ...]) -> ModuleArch:
    """The decoder: causal GQA attention and a SwiGLU MLP in every layer; a vocab-parallel lm_head.
    ``inputs``: the hand-off edges it consumes (by kwarg)."""
    lm = model.llm
    attn = Attention(
        kind="full",
        heads=lm.num_heads,
        kv_heads=lm.num_kv_heads,
        head_dim=lm.hidden_size // lm.num_heads,
        causal=True,
    )
    return ModuleArch(
        hidden=lm.hidden_size,
        blocks=uniform_blocks(lm.num_layers, attn, Mlp(kind="dense", intermediate=lm.intermediate_size)),
        params=llm_params(lm),
        block_params=llm_block_params(lm),
        largest_param=llm_largest_param(lm),
        inputs=inputs,
        head_macs=float(lm.hidden_size * lm.vocab_size),
        vocab=lm.vocab_size,
        tp_input_grads=5,  # q, k, v, gate, up
        tensors_per_block=12,
        root_tensors=3,
    )


def llm_axes(
    *,
    heads: int,
    kv_heads: int,
    vocab: int,
    mlp: int,
    layers: int,
    tied: bool = False,
    sequence_parallel: bool = True,
    context_parallel: bool = True,
    pipeline: bool = True,
) -> ModuleAxes:
    """The decoder's axes (TP over heads, KV heads, vocabulary and MLP width; Megatron sequence
    parallelism inside TP, context parallelism and pipeline stages over its ``layers`` where the
    family's LLM module does them), declared once: read by validation and the search (from the
    schema's numbers) and by the runtime plan (from the transformers config's)."""
    return decoder_axes(
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        mlp=mlp,
        sequence_parallel=sequence_parallel,
        context_parallel=context_parallel,
        pipeline=pipeline,
        layers=layers,
        tied=tied,
    )
