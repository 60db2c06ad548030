"""The Qwen3 vision encoder's numbers without torch: validation, counts and the typed module (``ModuleArch``).

Shared by every family whose encoder is the Qwen3-VL design (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5): a ViT
with full attention in every block, an ungated MLP, a learned position table resampled bilinearly to
each image's patch grid, 2D rotary positions, a 2x2 patch merger to the LLM width and ``K`` DeepStack
mergers (``K = 0`` for Qwen3.5, which has none). The schema's ``model.vision`` carries the common sizes;
``model.vision.extra`` carries ``num_position_embeddings``, ``hidden_act`` and, only where ``K`` can be
above 0, ``deepstack_visual_indexes``.

Parameter counts follow transformers' modeling code exactly (each family's unit test builds the
modules on the meta device and compares). ``tp_sharded`` parameters are divided by the TP degree,
``replicated`` ones are whole on every TP rank (the plan of ``dhp/models/qwen3_vision/tp.py``):

- block: LayerNorm x2 (weight + bias, replicated), fused qkv h->3h (+bias, colwise), proj h->h (+bias,
  rowwise: bias replicated), MLP linear_fc1 h->m (+bias, colwise), linear_fc2 m->h (+bias, rowwise);
- mergers: LayerNorm over h (main merger) or over 4h (each DeepStack merger, after the 2x2 shuffle),
  linear_fc1 4h->4h (+bias, colwise), GELU, linear_fc2 4h->out (+bias, rowwise);
- patch embedding Conv3d with bias and the position table (replicated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dhp.config.issues import Issues
from dhp.models.arch import (
    VISION_SIZES,
    Attention,
    Mlp,
    ModuleArch,
    ModuleAxes,
    ParamCount,
    encoder_axes,
    uniform_blocks,
)

IMAGE_EMBEDS = "image_embeds"
DEEPSTACK_PREFIX = "deepstack_embeds_"
#: the ``model.vision.extra`` keys of an encoder without / with DeepStack
VISION_EXTRA = ("num_position_embeddings", "hidden_act")
DEEPSTACK_EXTRA = (*VISION_EXTRA, "deepstack_visual_indexes")


def deepstack_kwarg(level: int) -> str:
    """The hand-off kwarg of DeepStack level ``level`` (0 = added after the first decoder layer)."""
    return f"{DEEPSTACK_PREFIX}{level}"


@dataclass(frozen=True)
class MergerNames:
    """Where transformers' encoder keeps its mergers' Linears: ``deepstack`` the attribute holding the
    DeepStack mergers, ``fc1`` / ``fc2`` each merger's two Linears (Qwen3-VL and Qwen3.5:
    ``deepstack_merger_list``, ``linear_fc1``, ``linear_fc2``; Qwen3-Omni: ``merger_list``, ``mlp.0``,
    ``mlp.2``)."""

    deepstack: str = "deepstack_merger_list"
    fc1: str = "linear_fc1"
    fc2: str = "linear_fc2"


QWEN3_VL_MERGERS = MergerNames()


def vision_tp_sharded(*, deepstack: bool, mergers: MergerNames = QWEN3_VL_MERGERS) -> tuple[str, ...]:
    """The encoder's TP-sharded module globs (``Capabilities.tp_sharded["vision"]``); ``mergers``: where
    the encoder keeps its mergers' Linears."""
    merger = ("linear_fc*",) if mergers == QWEN3_VL_MERGERS else (mergers.fc1, mergers.fc2)
    globs = (
        "visual.blocks.*.attn.qkv",
        "visual.blocks.*.attn.proj",
        "visual.blocks.*.mlp.*",
        *(f"visual.merger.{fc}" for fc in merger),
    )
    return (*globs, *(f"visual.{mergers.deepstack}.*.{fc}" for fc in merger)) if deepstack else globs


@dataclass(frozen=True)
class VisionNumbers:
    """Every architecture number of the encoder, from the schema or from a transformers vision config."""

    depth: int
    hidden: int
    heads: int
    mlp: int
    patch_size: int
    merge: int
    temporal_patch_size: int
    in_channels: int
    num_position_embeddings: int
    deepstack: tuple[int, ...]  # encoder block indexes with a DeepStack merger; () without DeepStack
    act: str
    out_hidden: int  # every merger's output width (= the LLM hidden size)

    @property
    def levels(self) -> int:
        """K, the number of DeepStack levels."""
        return len(self.deepstack)

    @property
    def wide(self) -> int:
        """Width of one merged token before the merger's projection: ``hidden * merge**2``."""
        return self.hidden * self.merge**2

    @property
    def input_row(self) -> int:
        """Width of one patch row: ``C * T * P * P``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def vision_numbers(vision: Any, *, out_hidden: int, deepstack: bool) -> VisionNumbers:
    """The numbers of a schema ``model.vision`` block (``extra`` keys validated first)."""
    extra = vision.extra
    return VisionNumbers(
        depth=vision.depth,
        hidden=vision.hidden_size,
        heads=vision.num_heads,
        mlp=vision.intermediate_size,
        patch_size=vision.patch_size,
        merge=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size,
        in_channels=vision.in_channels,
        num_position_embeddings=extra["num_position_embeddings"],
        deepstack=tuple(extra["deepstack_visual_indexes"]) if deepstack else (),
        act=extra["hidden_act"],
        out_hidden=out_hidden,
    )


# --- parameter counts ------------------------------------------------------------------------------
def merger_counts(n: VisionNumbers, *, postshuffle: bool) -> ParamCount:
    """One merger: the main one (LayerNorm over ``hidden``) or a DeepStack one (over ``wide``)."""
    norm = 2 * (n.wide if postshuffle else n.hidden)
    return ParamCount(
        tp_sharded=n.wide * n.wide + n.wide + n.wide * n.out_hidden, replicated=norm + n.out_hidden
    )


def block_counts(n: VisionNumbers) -> ParamCount:
    """One encoder block (an FSDP unit)."""
    h, m = n.hidden, n.mlp
    return ParamCount(tp_sharded=3 * h * h + 3 * h + h * h + h * m + m + m * h, replicated=2 * 2 * h + h + h)


def module_counts(n: VisionNumbers) -> ParamCount:
    """Blocks, patch + position embeddings, the main merger and K DeepStack mergers."""
    h = n.hidden
    patch = n.input_row * h + h
    block = block_counts(n)
    main, deep = merger_counts(n, postshuffle=False), merger_counts(n, postshuffle=True)
    return ParamCount(
        tp_sharded=n.depth * block.tp_sharded + main.tp_sharded + n.levels * deep.tp_sharded,
        replicated=n.depth * block.replicated
        + patch
        + n.num_position_embeddings * h
        + main.replicated
        + n.levels * deep.replicated,
    )


def largest(n: VisionNumbers) -> int:
    """Elements of the encoder's largest single parameter tensor (before TP/FSDP sharding)."""
    h = n.hidden
    return max(
        n.wide * n.wide,
        n.wide * n.out_hidden,
        3 * h * h,
        h * n.mlp,
        n.input_row * h,
        n.num_position_embeddings * h,
    )


# --- validation ------------------------------------------------------------------------------------


def check_extra_keys(
    model: Any, part: str, keys: tuple[str, ...], issues: Issues, *, family: str, example: str
) -> bool:
    """``model.<part>.extra`` holds exactly ``keys``; else one issue pointing at ``example``'s YAML."""
    have = sorted(model[part].extra) if "extra" in model[part] else []
    missing = [k for k in keys if k not in have]
    unknown = [k for k in have if k not in keys]
    return issues.check(
        not missing and not unknown,
        f"model.{part}.extra",
        have,
        f"{family} needs exactly {list(keys)} here (missing {missing}, unknown {unknown})",
        f"copy model.{part}.extra from conf/model/{example}.yaml",
    )


def validate_sizes(model: Any, issues: Issues, *, family: str, example: str, deepstack: bool) -> bool:
    """Positive sizes and the exact ``model.vision.extra`` keys; False when the numbers cannot be read."""
    issues.positive(model.vision, "model.vision", list(VISION_SIZES))
    keys = DEEPSTACK_EXTRA if deepstack else VISION_EXTRA
    return check_extra_keys(model, "vision", keys, issues, family=family, example=example)


def validate_numbers(n: VisionNumbers, issues: Issues, *, llm_layers: int) -> None:
    """Add an issue for every encoder number that does not build the encoder (sizes already positive)."""
    side = math.isqrt(int(n.num_position_embeddings))
    issues.check(
        side * side == n.num_position_embeddings and side > 1,
        "model.vision.extra.num_position_embeddings",
        n.num_position_embeddings,
        "must be a square > 1 (the learned position grid is side x side)",
        "use the published 2304 = 48 * 48",
    )
    levels = list(n.deepstack)
    issues.check(
        len(set(levels)) == len(levels) and all(0 <= i < n.depth for i in levels),
        "model.vision.extra.deepstack_visual_indexes",
        levels,
        f"must be distinct encoder block indexes in [0, depth={n.depth})",
        "use e.g. the published [8, 16, 24]",
    )
    issues.check(
        len(levels) <= llm_layers,
        "model.vision.extra.deepstack_visual_indexes",
        levels,
        f"{len(levels)} DeepStack levels but the LLM has {llm_layers} layers (level k is added after layer k)",
        "use at most model.llm.num_layers levels",
    )
    issues.check(
        n.hidden % n.heads == 0,
        "model.vision.num_heads",
        n.heads,
        f"must divide model.vision.hidden_size={n.hidden}",
        "pick a divisor",
    )


# --- typed architecture ----------------------------------------------------------------------------
def edges(n: VisionNumbers) -> tuple[str, ...]:
    """The hand-off edges encoder -> LLM: the merged image features, then one per DeepStack level."""
    return (IMAGE_EMBEDS, *(deepstack_kwarg(k) for k in range(n.levels)))


def vision_arch(n: VisionNumbers) -> ModuleArch:
    """The encoder: full attention in every block, an ungated MLP, the main merger and one merger per
    DeepStack level (each 2x2-merged rows to the LLM width)."""
    attn = Attention(kind="full", heads=n.heads, kv_heads=n.heads, head_dim=n.hidden // n.heads)
    merge = n.merge**2
    mergers = 1 + n.levels
    return ModuleArch(
        hidden=n.hidden,
        blocks=uniform_blocks(n.depth, attn, Mlp(kind="dense", intermediate=n.mlp, gated=False)),
        params=module_counts(n),
        block_params=block_counts(n),
        largest_param=largest(n),
        outputs=edges(n),
        handoff_width=mergers * n.out_hidden,
        out_width=n.out_hidden,
        input_row=n.input_row,
        merge=merge,
        temporal_patch=n.temporal_patch_size,
        head_macs=mergers * (n.wide * n.wide + n.wide * n.out_hidden) / merge,
        sp_unit=merge,  # the SP cut is a contiguous slice of whole merge units (sp.py)
        side_mergers=n.levels,
        tp_input_grads=2,  # fused qkv, linear_fc1
        tensors_per_block=12,  # 2 LayerNorms, qkv, proj, fc1, fc2: weight + bias each
        root_tensors=3 + 6 * mergers,  # patch conv weight + bias, position table; per merger 6
    )


def vision_axes(n: VisionNumbers) -> ModuleAxes:
    """TP (heads, merger width) and Ulysses SP (heads, every block)."""
    return encoder_axes(heads=n.heads, merged_width=n.wide)
