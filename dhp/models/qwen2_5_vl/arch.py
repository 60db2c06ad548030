"""Qwen2.5-VL's architecture numbers without torch: validation, geometry, and parameter counts
split by how tensor parallelism shards them (``ARCH``, a :class:`dhp.models.arch.FamilyArch`).

The counts follow transformers' modeling code exactly (a unit test instantiates the real model on
the meta device and compares). ``tp_sharded`` parameters are divided by the TP degree (attention
and MLP projections, and for the LLM the vocab-parallel ``embed_tokens``/``lm_head``);
``replicated`` ones are held whole by every TP rank (norms, the patch embedding, the bias of
row-parallel projections). The merger's MLP is column- then row-parallel, as in
``dhp/parallel/vision_tp.py``.
"""

from __future__ import annotations

from omegaconf import DictConfig

from dhp.config.issues import Issues
from dhp.models.arch import (
    LLM_SIZES,
    VISION_SIZES,
    Architecture,
    Attention,
    Block,
    Capabilities,
    Mlp,
    ModuleArch,
    ModuleAxes,
    ParamCount,
    decoder_axes,
    encoder_axes,
    uniform_blocks,
)

#: What this family's runtime does exactly (packing and video have parity tests).
CAPABILITIES = Capabilities(
    packing=True,
    video=True,
    tp_sharded={
        "vision": (
            "visual.blocks.*.attn.qkv",
            "visual.blocks.*.attn.proj",
            "visual.blocks.*.mlp.*",
            "visual.merger.mlp.*",
        ),
        "llm": ("*.embed_tokens", "*.layers.*.self_attn.*_proj", "*.layers.*.mlp.*", "lm_head"),
    },
)


def vision_params(vision: DictConfig, *, out_hidden: int) -> ParamCount:
    """Vision encoder incl. patch embedding and merger (``Qwen2_5_VisionTransformerPretrainedModel``).

    Block: RMSNorm x2 (h each), qkv Linear h->3h (+bias), proj h->h (+bias), SwiGLU MLP with
    bias (gate/up h->m, down m->h). Merger: RMSNorm(h), Linear 4h->4h (+bias), GELU,
    Linear 4h->out (+bias). Patch embedding: Conv3d without bias, C*T*P*P -> h.
    """
    h, m = vision.hidden_size, vision.intermediate_size
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2 * h
    block_sharded = 3 * h * h + 3 * h + h * h + 2 * (h * m + m) + m * h
    block_replicated = 2 * h + h + h  # norm1, norm2, bias of proj and down (row-parallel)
    merge_h = h * vision.spatial_merge_size**2
    merger_sharded = merge_h * merge_h + merge_h + merge_h * out_hidden  # mlp.0 column-, mlp.2 row-parallel
    merger_replicated = h + out_hidden  # ln_q, bias of mlp.2
    return ParamCount(
        tp_sharded=vision.depth * block_sharded + merger_sharded,
        replicated=vision.depth * block_replicated + patch + merger_replicated,
    )


def llm_params(llm: DictConfig) -> ParamCount:
    """Language model incl. embeddings, final norm and lm_head (unless tied).

    Layer: RMSNorm x2, q h->h (+bias), k/v h->kv (+bias), o h->h (no bias), MLP gate/up h->m,
    down m->h (no bias). Embeddings and lm_head are vocab-parallel under TP.
    """
    h, m, v = llm.hidden_size, llm.intermediate_size, llm.vocab_size
    kv = llm.num_kv_heads * (h // llm.num_heads)
    layer_sharded = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * m
    layer_replicated = 2 * h
    embeddings = v * h * (1 if llm.tie_word_embeddings else 2)
    return ParamCount(
        tp_sharded=llm.num_layers * layer_sharded + embeddings,
        replicated=llm.num_layers * layer_replicated + h,
    )


def module_params(name: str, model: DictConfig) -> ParamCount:
    """Parameter count of module ``name`` (``vision`` or ``llm``) of ``model``."""
    if name == "vision":
        return vision_params(model.vision, out_hidden=model.llm.hidden_size)
    return llm_params(model.llm)


def layer_params(name: str, model: DictConfig) -> ParamCount:
    """Parameters of ONE transformer block of module ``name`` (an FSDP unit: all-gathered at once)."""
    if name == "vision":
        v = model.vision
        h, m = v.hidden_size, v.intermediate_size
        return ParamCount(tp_sharded=3 * h * h + 3 * h + h * h + 2 * (h * m + m) + m * h, replicated=4 * h)
    lm = model.llm
    h, m = lm.hidden_size, lm.intermediate_size
    kv = lm.num_kv_heads * (h // lm.num_heads)
    return ParamCount(tp_sharded=(h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * m, replicated=2 * h)


def largest_param(name: str, model: DictConfig) -> int:
    """Elements of the module's largest single parameter tensor (before TP/FSDP sharding)."""
    if name == "vision":
        v = model.vision
        h, merge_h = v.hidden_size, v.hidden_size * v.spatial_merge_size**2
        return max(merge_h * merge_h, merge_h * model.llm.hidden_size, 3 * h * h, h * v.intermediate_size)
    lm = model.llm
    return max(lm.vocab_size * lm.hidden_size, lm.hidden_size * lm.intermediate_size)


VISION_EXTRA = ("window_size", "fullatt_block_indexes")
LLM_EXTRA = ("mrope_section",)


def _validate_vision_arch(v: DictConfig, issues: Issues) -> None:
    issues.positive(v, "model.vision", list(VISION_SIZES))
    if v.num_heads > 0:
        issues.check(
            v.hidden_size % v.num_heads == 0,
            "model.vision.hidden_size",
            v.hidden_size,
            f"must be divisible by model.vision.num_heads={v.num_heads}",
            "pick a head count that divides the hidden size",
        )
    have = sorted(v.extra) if "extra" in v else []
    if not issues.check(
        have == sorted(VISION_EXTRA),
        "model.vision.extra",
        have,
        f"qwen2_5_vl needs exactly {list(VISION_EXTRA)} here (its window geometry)",
        "copy model.vision.extra from conf/model/qwen_vl_7b.yaml",
    ):
        return
    window, full = v.extra["window_size"], list(v.extra["fullatt_block_indexes"])
    unit = v.patch_size * v.spatial_merge_size
    if unit > 0:
        issues.check(
            window > 0 and window % unit == 0,
            "model.vision.extra.window_size",
            window,
            f"must be a positive multiple of patch_size*spatial_merge_size={unit}",
            f"use a multiple of {unit}",
        )
    bad = [i for i in full if not 0 <= i < v.depth]
    issues.check(
        not bad,
        "model.vision.extra.fullatt_block_indexes",
        full,
        f"indexes {bad} outside [0, depth={v.depth})",
        "list block indexes smaller than model.vision.depth",
    )


def _validate_llm_arch(lm: DictConfig, issues: Issues) -> None:
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


def vision_arch(model: DictConfig) -> ModuleArch:
    """The encoder: window attention except in ``extra.fullatt_block_indexes``; a 2x2 merger to the LLM width."""
    v, out = model.vision, model.llm.hidden_size
    h, head = v.hidden_size, v.hidden_size // v.num_heads
    window = (v.extra["window_size"] // v.patch_size) ** 2
    full = Attention(kind="full", heads=v.num_heads, kv_heads=v.num_heads, head_dim=head)
    win = Attention(kind="window", heads=v.num_heads, kv_heads=v.num_heads, head_dim=head, window=window)
    mlp = Mlp(kind="dense", intermediate=v.intermediate_size)
    full_at = set(v.extra["fullatt_block_indexes"])
    merge, merged = v.spatial_merge_size**2, h * v.spatial_merge_size**2
    return ModuleArch(
        hidden=h,
        blocks=tuple(Block(full if i in full_at else win, mlp) for i in range(v.depth)),
        params=module_params("vision", model),
        block_params=layer_params("vision", model),
        largest_param=largest_param("vision", model),
        outputs=("image_embeds",),
        handoff_width=out,
        out_width=out,
        input_row=v.in_channels * v.temporal_patch_size * v.patch_size**2,
        merge=merge,
        temporal_patch=v.temporal_patch_size,
        head_macs=(merged * merged + merged * out) / merge,
        sp_unit=window,
        tp_input_grads=3,  # fused qkv, gate, up
        tensors_per_block=12,
        root_tensors=6,
    )


def llm_arch(model: DictConfig) -> ModuleArch:
    """The decoder: causal GQA attention and a SwiGLU MLP in every layer; a vocab-parallel lm_head."""
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
        params=module_params("llm", model),
        block_params=layer_params("llm", model),
        largest_param=largest_param("llm", model),
        inputs=("image_embeds",),
        head_macs=float(lm.hidden_size * lm.vocab_size),
        vocab=lm.vocab_size,
        tp_input_grads=5,  # q, k, v, gate, up
        tensors_per_block=12,
        root_tensors=3,
    )


class Qwen25VLArch:
    """:class:`dhp.models.arch.FamilyArch` of Qwen2.5-VL (``vision.extra``: its window geometry)."""

    module_names: tuple[str, ...] = ("vision", "llm")  # producers first

    def validate(self, model: DictConfig, issues: Issues) -> None:
        _validate_vision_arch(model.vision, issues)
        have = sorted(model.llm.extra) if "extra" in model.llm else []
        issues.check(
            have == sorted(LLM_EXTRA),
            "model.llm.extra",
            have,
            f"qwen2_5_vl needs exactly {list(LLM_EXTRA)} here (its M-RoPE split)",
            "copy model.llm.extra from conf/model/qwen_vl_7b.yaml",
        )
        _validate_llm_arch(model.llm, issues)

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def architecture(self, model: DictConfig) -> Architecture:
        return Architecture(
            modules={"vision": vision_arch(model), "llm": llm_arch(model)}, capabilities=CAPABILITIES
        )

    def module_axes(self, name: str, model: DictConfig) -> ModuleAxes:
        """Encoder: TP (heads, merger width) and Ulysses SP (heads). LLM: TP with SP inside it."""
        if name == "vision":
            v = model.vision
            return vision_axes(heads=v.num_heads, hidden=v.hidden_size, merge=v.spatial_merge_size)
        lm = model.llm
        return llm_axes(
            heads=lm.num_heads,
            kv_heads=lm.num_kv_heads,
            vocab=lm.vocab_size,
            mlp=lm.intermediate_size,
            layers=lm.num_layers,
            tied=bool(lm.tie_word_embeddings),
        )


def vision_axes(*, heads: int, hidden: int, merge: int) -> ModuleAxes:
    """The encoder's axes, declared once: read by validation and the search (from the schema's numbers)
    and by the runtime plan (``parallel.py``, from the transformers config's)."""
    return encoder_axes(heads=heads, merged_width=hidden * merge**2)


def llm_axes(
    *, heads: int, kv_heads: int, vocab: int, mlp: int, layers: int, tied: bool = False
) -> ModuleAxes:
    """The decoder's axes (TP over heads, KV heads, vocabulary and MLP width, with sequence parallelism
    inside TP; context parallelism: the LLM computes M-RoPE on the whole sequence, then cuts; pipeline
    stages over its ``layers`` decoder layers), declared once as :func:`vision_axes`."""
    return decoder_axes(
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        mlp=mlp,
        sequence_parallel=True,
        context_parallel=True,
        pipeline=True,
        layers=layers,
        tied=tied,
    )


ARCH = Qwen25VLArch()
