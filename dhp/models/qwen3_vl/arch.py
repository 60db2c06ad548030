"""Qwen3-VL's architecture numbers without torch: validation, geometry and parameter counts (``ARCH``).

The schema's ``model.vision`` / ``model.llm`` carry the numbers every Qwen-style VLM has; Qwen3-VL's
own go into their ``extra`` maps and are checked here:

- ``vision.extra``: ``num_position_embeddings`` (the learned position table, a square grid resampled
  bilinearly to each image's patch grid), ``deepstack_visual_indexes`` (encoder blocks whose merged
  features are added to the LLM's hidden states after layers 0, 1, ...), ``hidden_act``;
- ``llm.extra``: ``head_dim`` (not ``hidden / heads`` in the 32B), ``hidden_act``, ``mrope_interleaved``.

Every encoder block is full attention (the typed architecture, :func:`vision_arch`, says so).

Parameter counts follow transformers' modeling code exactly (a unit test builds the modules on the
meta device and compares). ``tp_sharded`` parameters are divided by the TP degree, ``replicated`` ones
are whole on every TP rank (the TP plan of ``dhp/models/qwen3_vl/tp.py``):

- vision block: LayerNorm x2 (weight + bias, replicated), fused qkv h->3h (+bias, colwise), proj h->h
  (+bias, rowwise: bias replicated), MLP linear_fc1 h->m (+bias, colwise), linear_fc2 m->h (+bias, rowwise);
- mergers: LayerNorm over h (main merger) or over 4h (each DeepStack merger, after the 2x2 shuffle),
  linear_fc1 4h->4h (+bias, colwise), GELU, linear_fc2 4h->out (+bias, rowwise); patch embedding
  Conv3d with bias and the position table (replicated);
- LLM layer (Qwen3): RMSNorm x2, q h->heads*head_dim, k/v h->kv_heads*head_dim, o heads*head_dim->h (no
  biases), q_norm/k_norm over head_dim (replicated), SwiGLU gate/up h->m, down m->h; vocab-parallel
  embeddings and lm_head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dhp.config.issues import Issues
from dhp.models.arch import (
    Architecture,
    Attention,
    Capabilities,
    LayerShape,
    Mlp,
    ModuleArch,
    ModuleAxes,
    ParamCount,
    uniform_blocks,
)

#: What this family's runtime does exactly. Packing and video are not declared: the LLM's position
#: ids and DeepStack placement have no per-sample (packed) path and no video parity test, so
#: validation refuses ``data.packing`` and video data for this family.
CAPABILITIES = Capabilities(
    packing=False,
    video=False,
    tp_sharded={
        "vision": (
            "visual.blocks.*.attn.qkv",
            "visual.blocks.*.attn.proj",
            "visual.blocks.*.mlp.*",
            "visual.merger.linear_fc*",
            "visual.deepstack_merger_list.*.linear_fc*",
        ),
        "llm": ("*.embed_tokens", "*.layers.*.self_attn.*_proj", "*.layers.*.mlp.*", "lm_head"),
    },
)

VISION_EXTRA = ("num_position_embeddings", "deepstack_visual_indexes", "hidden_act")
LLM_EXTRA = ("head_dim", "hidden_act", "mrope_interleaved", "mrope_section")


@dataclass(frozen=True)
class Numbers:
    """Every architecture number of a Qwen3-VL model, from the schema or from a transformers config."""

    depth: int
    vision_hidden: int
    vision_heads: int
    vision_mlp: int
    patch_size: int
    merge: int
    temporal_patch_size: int
    in_channels: int
    num_position_embeddings: int
    deepstack: tuple[int, ...]
    vision_act: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    tied: bool
    llm_act: str
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int

    @property
    def out_hidden(self) -> int:
        """Width of every merger's output (= the LLM hidden size)."""
        return self.hidden

    @property
    def q_dim(self) -> int:
        """Width of the query / attention output: ``heads * head_dim`` (8192 != 5120 in the 32B)."""
        return self.heads * self.head_dim


def numbers(model: Any) -> Numbers:
    """The numbers of a schema ``model`` block (DictConfig or dataclass; ``extra`` keys validated first)."""
    v, t = model.vision, model.llm
    ve, te = v.extra, t.extra
    return Numbers(
        depth=v.depth,
        vision_hidden=v.hidden_size,
        vision_heads=v.num_heads,
        vision_mlp=v.intermediate_size,
        patch_size=v.patch_size,
        merge=v.spatial_merge_size,
        temporal_patch_size=v.temporal_patch_size,
        in_channels=v.in_channels,
        num_position_embeddings=ve["num_position_embeddings"],
        deepstack=tuple(ve["deepstack_visual_indexes"]),
        vision_act=ve["hidden_act"],
        hidden=t.hidden_size,
        layers=t.num_layers,
        heads=t.num_heads,
        kv_heads=t.num_kv_heads,
        head_dim=te["head_dim"],
        mlp=t.intermediate_size,
        vocab=t.vocab_size,
        tied=bool(t.tie_word_embeddings),
        llm_act=te["hidden_act"],
        mrope_section=tuple(te["mrope_section"]),
        mrope_interleaved=bool(te["mrope_interleaved"]),
        rope_theta=float(t.rope_theta),
        rms_norm_eps=float(t.rms_norm_eps),
        max_position_embeddings=t.max_position_embeddings,
    )


# --- parameter counts ------------------------------------------------------------------------------
def _merger(n: Numbers, *, postshuffle: bool) -> ParamCount:
    wide = n.vision_hidden * n.merge**2
    norm = 2 * (wide if postshuffle else n.vision_hidden)
    return ParamCount(tp_sharded=wide * wide + wide + wide * n.out_hidden, replicated=norm + n.out_hidden)


def vision_block(n: Numbers) -> ParamCount:
    """One encoder block (an FSDP unit)."""
    h, m = n.vision_hidden, n.vision_mlp
    return ParamCount(tp_sharded=3 * h * h + 3 * h + h * h + h * m + m + m * h, replicated=2 * 2 * h + h + h)


def llm_block(n: Numbers) -> ParamCount:
    """One decoder layer (an FSDP unit)."""
    h, kv = n.hidden, n.kv_heads * n.head_dim
    return ParamCount(
        tp_sharded=h * n.q_dim + 2 * h * kv + n.q_dim * h + 3 * h * n.mlp, replicated=2 * h + 2 * n.head_dim
    )


def module_counts(name: str, n: Numbers) -> ParamCount:
    """``vision``: blocks, patch + position embeddings, merger, DeepStack mergers; ``llm``: layers,
    embeddings, final norm and lm_head unless tied."""
    if name == "vision":
        h = n.vision_hidden
        patch = n.in_channels * n.temporal_patch_size * n.patch_size**2 * h + h
        block, main, deep = vision_block(n), _merger(n, postshuffle=False), _merger(n, postshuffle=True)
        k = len(n.deepstack)
        return ParamCount(
            tp_sharded=n.depth * block.tp_sharded + main.tp_sharded + k * deep.tp_sharded,
            replicated=n.depth * block.replicated
            + patch
            + n.num_position_embeddings * h
            + main.replicated
            + k * deep.replicated,
        )
    block = llm_block(n)
    embeddings = n.vocab * n.hidden * (1 if n.tied else 2)
    return ParamCount(
        tp_sharded=n.layers * block.tp_sharded + embeddings, replicated=n.layers * block.replicated + n.hidden
    )


def block_counts(name: str, n: Numbers) -> ParamCount:
    """Parameters of ONE block of module ``name``."""
    return vision_block(n) if name == "vision" else llm_block(n)


def largest(name: str, n: Numbers) -> int:
    """Elements of the module's largest single parameter tensor (before TP/FSDP sharding)."""
    if name == "vision":
        h, wide = n.vision_hidden, n.vision_hidden * n.merge**2
        patch = n.in_channels * n.temporal_patch_size * n.patch_size**2 * h
        return max(
            wide * wide,
            wide * n.out_hidden,
            3 * h * h,
            h * n.vision_mlp,
            patch,
            n.num_position_embeddings * h,
        )
    return max(n.vocab * n.hidden, n.hidden * n.mlp, n.hidden * n.q_dim)


def shape(name: str, n: Numbers) -> LayerShape:
    """Activation-relevant sizes of one block (the LLM's ``kv_dim`` uses the real ``head_dim``)."""
    if name == "vision":
        return LayerShape(
            hidden=n.vision_hidden,
            mlp=n.vision_mlp,
            kv_dim=n.vision_hidden,
            heads=n.vision_heads,
            layers=n.depth,
            tp_input_grads=2,  # fused qkv, linear_fc1
        )
    return LayerShape(
        hidden=n.hidden,
        mlp=n.mlp,
        kv_dim=n.kv_heads * n.head_dim,
        heads=n.heads,
        layers=n.layers,
        q_dim=n.heads * n.head_dim,
    )


# --- validation ------------------------------------------------------------------------------------
_VISION_SIZES = [
    "depth",
    "hidden_size",
    "num_heads",
    "intermediate_size",
    "patch_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "in_channels",
]
_LLM_SIZES = ["hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"]


def _extra_keys(model: Any, part: str, keys: tuple[str, ...], issues: Issues) -> bool:
    have = sorted(model[part].extra) if "extra" in model[part] else []
    missing = [k for k in keys if k not in have]
    unknown = [k for k in have if k not in keys]
    return issues.check(
        not missing and not unknown,
        f"model.{part}.extra",
        have,
        f"qwen3_vl needs exactly {list(keys)} here (missing {missing}, unknown {unknown})",
        f"copy model.{part}.extra from conf/model/qwen3_vl_8b.yaml",
    )


def validate(model: Any, issues: Issues) -> None:
    """Add an issue for every number that does not build a Qwen3-VL model."""
    issues.positive(model.vision, "model.vision", _VISION_SIZES)
    issues.positive(model.llm, "model.llm", _LLM_SIZES)
    ok = _extra_keys(model, "vision", VISION_EXTRA, issues)
    ok = _extra_keys(model, "llm", LLM_EXTRA, issues) and ok
    if not ok or issues.items:
        return
    n = numbers(model)
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
        len(levels) <= n.layers,
        "model.vision.extra.deepstack_visual_indexes",
        levels,
        f"{len(levels)} DeepStack levels but the LLM has {n.layers} layers (level k is added after layer k)",
        "use at most model.llm.num_layers levels",
    )
    issues.check(
        n.vision_hidden % n.vision_heads == 0,
        "model.vision.num_heads",
        n.vision_heads,
        f"must divide model.vision.hidden_size={n.vision_hidden}",
        "pick a divisor",
    )
    issues.check(
        n.heads % n.kv_heads == 0,
        "model.llm.num_kv_heads",
        n.kv_heads,
        f"must divide model.llm.num_heads={n.heads} (grouped-query attention)",
        "pick a divisor",
    )
    issues.check(
        len(n.mrope_section) == 3 and 2 * sum(n.mrope_section) == n.head_dim,
        "model.llm.extra.mrope_section",
        list(n.mrope_section),
        f"must be 3 numbers summing to head_dim / 2 = {n.head_dim // 2}",
        "use the published [24, 20, 20] for head_dim 128",
    )
    issues.check(
        n.mrope_interleaved,
        "model.llm.extra.mrope_interleaved",
        n.mrope_interleaved,
        "Qwen3-VL's rotary embedding is always interleaved",
        "set it to true",
    )


def edges(n: Numbers) -> tuple[str, ...]:
    """The hand-off edges encoder -> LLM: the merged image features, then one per DeepStack level."""
    return ("image_embeds", *(f"deepstack_embeds_{k}" for k in range(len(n.deepstack))))


def vision_arch(n: Numbers) -> ModuleArch:
    """The encoder: full attention in every block, an ungated MLP, the main merger and one merger per
    DeepStack level (each 2x2-merged rows to the LLM width)."""
    h = n.vision_hidden
    attn = Attention(kind="full", heads=n.vision_heads, kv_heads=n.vision_heads, head_dim=h // n.vision_heads)
    merge, wide = n.merge**2, h * n.merge**2
    mergers = 1 + len(n.deepstack)
    return ModuleArch(
        hidden=h,
        blocks=uniform_blocks(n.depth, attn, Mlp(kind="dense", intermediate=n.vision_mlp, gated=False)),
        params=module_counts("vision", n),
        block_params=block_counts("vision", n),
        largest_param=largest("vision", n),
        outputs=edges(n),
        handoff_width=mergers * n.out_hidden,
        out_width=n.out_hidden,
        input_row=n.in_channels * n.temporal_patch_size * n.patch_size**2,
        merge=merge,
        temporal_patch=n.temporal_patch_size,
        head_macs=mergers * (wide * wide + wide * n.out_hidden) / merge,
        sp_unit=merge,  # the SP cut is a contiguous slice of whole merge units (sp.py)
        tp_input_grads=2,  # fused qkv, linear_fc1
        tensors_per_block=12,  # 2 LayerNorms, qkv, proj, fc1, fc2: weight + bias each
        root_tensors=3 + 6 * mergers,  # patch conv weight + bias, position table; per merger 6
    )


def llm_arch(n: Numbers) -> ModuleArch:
    """The decoder: causal GQA attention with ``head_dim`` per head, a SwiGLU MLP; vocab-parallel lm_head."""
    attn = Attention(kind="full", heads=n.heads, kv_heads=n.kv_heads, head_dim=n.head_dim, causal=True)
    return ModuleArch(
        hidden=n.hidden,
        blocks=uniform_blocks(n.layers, attn, Mlp(kind="dense", intermediate=n.mlp)),
        params=module_counts("llm", n),
        block_params=block_counts("llm", n),
        largest_param=largest("llm", n),
        inputs=edges(n),
        head_macs=float(n.hidden * n.vocab),
        vocab=n.vocab,
        tp_input_grads=5,  # q, k, v, gate, up
        tensors_per_block=11,  # 2 norms, q/k/v/o, q_norm, k_norm, gate/up/down (no biases)
        root_tensors=3,
    )


class Qwen3VLArch:
    """:class:`dhp.models.arch.FamilyArch` of Qwen3-VL (reads ``model.vision.extra`` / ``model.llm.extra``)."""

    def validate(self, model: Any, issues: Issues) -> None:
        validate(model, issues)

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def architecture(self, model: Any) -> Architecture:
        n = numbers(model)
        return Architecture(modules={"vision": vision_arch(n), "llm": llm_arch(n)}, capabilities=CAPABILITIES)

    def module_params(self, name: str, model: Any) -> ParamCount:
        return module_counts(name, numbers(model))

    def layer_params(self, name: str, model: Any) -> ParamCount:
        return block_counts(name, numbers(model))

    def largest_param(self, name: str, model: Any) -> int:
        return largest(name, numbers(model))

    def layer_shape(self, name: str, model: Any) -> LayerShape:
        return shape(name, numbers(model))

    def module_axes(self, name: str, model: Any) -> ModuleAxes:
        """Encoder: TP (heads, merger width) and Ulysses SP (heads, every block). LLM: TP without
        sequence parallelism inside it (the DeepStack adds need the full sequence)."""
        n = numbers(model)
        if name == "vision":
            heads = {"model.vision.num_heads": n.vision_heads}
            wide = {"model.vision.hidden_size*spatial_merge_size^2": n.vision_hidden * n.merge**2}
            return ModuleAxes(
                tp=True, sp=True, tp_sequence_parallel=False, tp_divides=heads | wide, sp_divides=heads
            )
        return ModuleAxes(
            tp=True,
            sp=False,
            tp_sequence_parallel=False,
            tp_divides={
                "model.llm.num_heads": n.heads,
                "model.llm.num_kv_heads": n.kv_heads,
                "model.llm.vocab_size": n.vocab,
                "model.llm.intermediate_size": n.mlp,
            },
        )


ARCH = Qwen3VLArch()
