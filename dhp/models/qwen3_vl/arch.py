"""Qwen3-VL's architecture numbers without torch: validation, geometry and parameter counts (``ARCH``).

The schema's ``model.vision`` / ``model.llm`` carry the numbers every Qwen-style VLM has; Qwen3-VL's
own go into their ``extra`` maps and are checked here:

- ``vision.extra``: ``num_position_embeddings`` (the learned position table, a square grid resampled
  bilinearly to each image's patch grid), ``deepstack_visual_indexes`` (encoder blocks whose merged
  features are added to the LLM's hidden states after layers 0, 1, ...), ``hidden_act``;
- ``llm.extra``: ``head_dim`` (not ``hidden / heads`` in the 32B), ``hidden_act``, ``mrope_interleaved``.

The encoder's numbers, validation, counts and typed module are the shared Qwen3 vision encoder's
(``dhp/models/qwen3_vision/arch.py``, with DeepStack); this file adds the LLM's.

Parameter counts follow transformers' modeling code exactly (a unit test builds the modules on the
meta device and compares). ``tp_sharded`` parameters are divided by the TP degree, ``replicated`` ones
are whole on every TP rank (the TP plan of ``dhp/models/qwen3_vl/tp.py``):

- LLM layer (Qwen3): RMSNorm x2, q h->heads*head_dim, k/v h->kv_heads*head_dim, o heads*head_dim->h (no
  biases), q_norm/k_norm over head_dim (replicated), SwiGLU gate/up h->m, down m->h; vocab-parallel
  embeddings and lm_head.
"""

from __future__ import annotations

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
from dhp.models.qwen3_vision import arch as vision
from dhp.models.qwen3_vision.arch import VisionNumbers, check_extra_keys

#: What this family's runtime does exactly. Packing and video are not declared: the LLM's position
#: ids and DeepStack placement have no per-sample (packed) path and no video parity test, so
#: validation refuses ``data.packing`` and video data for this family.
CAPABILITIES = Capabilities(
    packing=False,
    video=False,
    tp_sharded={
        "vision": vision.vision_tp_sharded(deepstack=True),
        "llm": ("*.embed_tokens", "*.layers.*.self_attn.*_proj", "*.layers.*.mlp.*", "lm_head"),
    },
)

LLM_EXTRA = ("head_dim", "hidden_act", "mrope_interleaved", "mrope_section")


@dataclass(frozen=True)
class Numbers:
    """Every architecture number of a Qwen3-VL model, from the schema or from a transformers config."""

    vision: VisionNumbers
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
    def q_dim(self) -> int:
        """Width of the query / attention output: ``heads * head_dim`` (8192 != 5120 in the 32B)."""
        return self.heads * self.head_dim


def numbers(model: Any) -> Numbers:
    """The numbers of a schema ``model`` block (DictConfig or dataclass; ``extra`` keys validated first)."""
    t = model.llm
    te = t.extra
    return Numbers(
        vision=vision.vision_numbers(model.vision, out_hidden=t.hidden_size, deepstack=True),
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
        return vision.module_counts(n.vision)
    block = llm_block(n)
    embeddings = n.vocab * n.hidden * (1 if n.tied else 2)
    return ParamCount(
        tp_sharded=n.layers * block.tp_sharded + embeddings, replicated=n.layers * block.replicated + n.hidden
    )


def block_counts(name: str, n: Numbers) -> ParamCount:
    """Parameters of ONE block of module ``name``."""
    return vision.block_counts(n.vision) if name == "vision" else llm_block(n)


def largest(name: str, n: Numbers) -> int:
    """Elements of the module's largest single parameter tensor (before TP/FSDP sharding)."""
    if name == "vision":
        return vision.largest(n.vision)
    return max(n.vocab * n.hidden, n.hidden * n.mlp, n.hidden * n.q_dim)


def shape(name: str, n: Numbers) -> LayerShape:
    """Activation-relevant sizes of one block (the LLM's ``kv_dim`` uses the real ``head_dim``)."""
    if name == "vision":
        return vision.shape(n.vision)
    return LayerShape(
        hidden=n.hidden,
        mlp=n.mlp,
        kv_dim=n.kv_heads * n.head_dim,
        heads=n.heads,
        layers=n.layers,
        q_dim=n.heads * n.head_dim,
    )


# --- validation ------------------------------------------------------------------------------------
_LLM_SIZES = ["hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"]


def validate(model: Any, issues: Issues) -> None:
    """Add an issue for every number that does not build a Qwen3-VL model."""
    ok = vision.validate_sizes(model, issues, family="qwen3_vl", example="qwen3_vl_8b", deepstack=True)
    issues.positive(model.llm, "model.llm", _LLM_SIZES)
    ok = check_extra_keys(model, "llm", LLM_EXTRA, issues, family="qwen3_vl", example="qwen3_vl_8b") and ok
    if not ok or issues.items:
        return
    n = numbers(model)
    vision.validate_numbers(n.vision, issues, llm_layers=n.layers)
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


def llm_arch(n: Numbers) -> ModuleArch:
    """The decoder: causal GQA attention with ``head_dim`` per head, a SwiGLU MLP; vocab-parallel lm_head."""
    attn = Attention(kind="full", heads=n.heads, kv_heads=n.kv_heads, head_dim=n.head_dim, causal=True, qk_norm=True)
    return ModuleArch(
        hidden=n.hidden,
        blocks=uniform_blocks(n.layers, attn, Mlp(kind="dense", intermediate=n.mlp)),
        params=module_counts("llm", n),
        block_params=block_counts("llm", n),
        largest_param=largest("llm", n),
        inputs=vision.edges(n.vision),
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
        return Architecture(
            modules={"vision": vision.vision_arch(n.vision), "llm": llm_arch(n)}, capabilities=CAPABILITIES
        )

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
            return vision.vision_axes(n.vision)
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
