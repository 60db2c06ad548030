"""The Qwen2.5-VL-style vision encoder's numbers without torch: validation, typed blocks, parameter
counts split by how tensor parallelism shards them, and its parallel axes.

Shared by Qwen2.5-VL and Qwen2.5-Omni (the same ViT: window attention except in
``extra.fullatt_block_indexes``, SwiGLU MLP with bias, a 2x2 merger to the LLM width). Omni's q/k/v are
three Linears where Qwen2.5-VL fuses them; the counts are the same. The counts follow transformers'
modeling code exactly (a unit test instantiates the real model on the meta device and compares).
"""

from __future__ import annotations

from dataclasses import replace

from omegaconf import DictConfig

from dhp.config.issues import Issues
from dhp.models.arch import (
    VISION_SIZES,
    Attention,
    Block,
    Mlp,
    ModuleArch,
    ModuleAxes,
    ParamCount,
    encoder_axes,
)

#: ``model.vision.extra`` keys of this encoder: its window geometry
VISION_EXTRA = ("window_size", "fullatt_block_indexes")


def vision_params(vision: DictConfig, *, out_hidden: int) -> ParamCount:
    """Vision encoder incl. patch embedding and merger.

    Block: RMSNorm x2 (h each), q/k/v h->h each (+bias; fused or not), proj h->h (+bias), SwiGLU MLP
    with bias (gate/up h->m, down m->h). Merger: RMSNorm(h), Linear 4h->4h (+bias), GELU, Linear
    4h->out (+bias). Patch embedding: Conv3d without bias, C*T*P*P -> h.
    """
    h = vision.hidden_size
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2 * h
    block = vision_block_params(vision)
    merge_h = h * vision.spatial_merge_size**2
    merger_sharded = merge_h * merge_h + merge_h + merge_h * out_hidden  # mlp.0 column-, mlp.2 row-parallel
    merger_replicated = h + out_hidden  # ln_q, bias of mlp.2
    return ParamCount(
        tp_sharded=vision.depth * block.tp_sharded + merger_sharded,
        replicated=vision.depth * block.replicated + patch + merger_replicated,
    )


def vision_block_params(vision: DictConfig) -> ParamCount:
    """ONE encoder block (an FSDP unit): the projections TP shards, and the norms and the biases of
    the row-parallel projections (proj, down) every TP rank holds."""
    h, m = vision.hidden_size, vision.intermediate_size
    return ParamCount(tp_sharded=3 * h * h + 3 * h + h * h + 2 * (h * m + m) + m * h, replicated=4 * h)


def vision_largest_param(vision: DictConfig, *, out_hidden: int) -> int:
    """Elements of the encoder's largest single parameter tensor (before TP/FSDP sharding)."""
    h, merge_h = vision.hidden_size, vision.hidden_size * vision.spatial_merge_size**2
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2 * h
    return max(merge_h * merge_h, merge_h * out_hidden, 3 * h * h, h * vision.intermediate_size, patch)


def validate_vision_arch(v: DictConfig, issues: Issues, *, family: str, example: str) -> None:
    """Issues for every number of ``model.vision`` this encoder cannot build (``example``: the
    ``conf/model`` entry whose ``extra`` to copy)."""
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
        f"{family} needs exactly {list(VISION_EXTRA)} here (its window geometry)",
        f"copy model.vision.extra from conf/model/{example}.yaml",
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


def vision_tp_sharded(*, fused_qkv: bool = True) -> tuple[str, ...]:
    """The module globs TP shards (``Capabilities.tp_sharded["vision"]``), as ``tp.vision_tp_plan``."""
    attention = ("qkv",) if fused_qkv else ("q", "k", "v")
    return (
        *(f"visual.blocks.*.attn.{p}" for p in attention),
        "visual.blocks.*.attn.proj",
        "visual.blocks.*.mlp.*",
        "visual.merger.mlp.*",
    )


def vision_arch(model: DictConfig, *, fused_qkv: bool = True) -> ModuleArch:
    """The encoder: window attention except in ``extra.fullatt_block_indexes``; a 2x2 merger to the
    LLM width. ``fused_qkv``: one qkv Linear (Qwen2.5-VL) or three (Qwen2.5-Omni)."""
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
        params=vision_params(v, out_hidden=out),
        block_params=vision_block_params(v),
        largest_param=vision_largest_param(v, out_hidden=out),
        outputs=("image_embeds",),
        handoff_width=out,
        out_width=out,
        input_row=v.in_channels * v.temporal_patch_size * v.patch_size**2,
        merge=merge,
        temporal_patch=v.temporal_patch_size,
        head_macs=(merged * merged + merged * out) / merge,
        sp_unit=window,
        tp_input_grads=3 if fused_qkv else 5,  # (fused qkv | q, k, v), gate, up
        tensors_per_block=12 if fused_qkv else 16,
        root_tensors=6,
    )


def vision_axes(*, heads: int, hidden: int, merge: int, ulysses: bool = True) -> ModuleAxes:
    """The encoder's axes, declared once: read by validation and the search (from the schema's numbers)
    and by the runtime plan (``tp.py``, from the transformers config's). ``ulysses`` False: no SP axis
    (Ulysses' hooks need a fused qkv Linear, ``dhp.parallel.ulysses``)."""
    axes = encoder_axes(heads=heads, merged_width=hidden * merge**2)
    return axes if ulysses else replace(axes, sp=False, sp_divides={})
