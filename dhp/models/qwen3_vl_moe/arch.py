"""Qwen3-VL-MoE's architecture numbers without torch: validation, geometry and parameter counts (``ARCH``).

The encoder is Qwen3-VL's (full attention, learned position grid, DeepStack mergers); the LLM is
Qwen3-MoE: every decoder layer whose MLP is sparse holds a top-k router ``gate.weight`` [E, H] and the
experts as two 3-D tensors ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I].

The schema's ``model.vision`` / ``model.llm`` carry the numbers every Qwen-style VLM has; the rest go
into their ``extra`` maps and are checked here:

- ``vision.extra``: ``num_position_embeddings``, ``deepstack_visual_indexes``, ``hidden_act``: the shared
  Qwen3 vision encoder's (``dhp/models/qwen3_vision/arch.py``, with DeepStack: numbers, validation,
  counts and typed module come from there);
- ``llm.extra``: ``head_dim``, ``hidden_act``, ``mrope_interleaved``, ``mrope_section`` (as Qwen3-VL)
  and the MoE numbers: ``num_experts`` (E), ``num_experts_per_tok`` (top-k), ``moe_intermediate_size``
  (I, one expert's width), ``decoder_sparse_step`` and ``mlp_only_layers`` (which layers are sparse:
  layer ``i`` is unless ``i`` is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``;
  the others are dense SwiGLU MLPs of ``model.llm.intermediate_size``), ``router_aux_loss_coef``
  (weight of the load-balancing loss added to the LM loss) and ``norm_topk_prob`` (transformers'
  router always renormalises the top-k probabilities, so only ``true`` builds the model it runs).

Parameter counts follow transformers' modeling code exactly (a unit test builds the modules on the
meta device and compares), split three ways (:class:`dhp.models.arch.ParamCount`):

- ``tp_sharded`` (divided by the TP degree): as Qwen3-VL's, attention q/k/v/o, the dense layers'
  gate/up/down, vocab-parallel embeddings and lm_head;
- ``replicated`` (whole on every rank): norms, q_norm/k_norm, and each sparse layer's router
  ``gate.weight`` [E, H] (EP replicates the router, TP does not shard it);
- ``expert`` (divided by the EP degree, whole on every TP rank: no expert TP): ``3 * E * I * H`` per
  sparse layer.

Active parameters (what one token passes through) count ``top_k`` of the ``E`` experts of each sparse
layer and everything else whole: :func:`active_params`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dhp.config.issues import Issues
from dhp.models.arch import (
    Architecture,
    Attention,
    Block,
    Capabilities,
    LayerShape,
    Mlp,
    ModuleArch,
    ModuleAxes,
    ParamCount,
)
from dhp.models.qwen3_vision import arch as vision
from dhp.models.qwen3_vision.arch import VisionNumbers, check_extra_keys

FAMILY_NAME = "qwen3_vl_moe"
EXAMPLE = "qwen3_vl_30b_a3b"  # the conf/model entry a validation message points at

#: What this family's runtime does exactly. Packing and video are not declared (as Qwen3-VL: the LLM's
#: position ids and DeepStack placement have no per-sample path, no video parity test).
CAPABILITIES = Capabilities(
    packing=False,
    video=False,
    tp_sharded={
        "vision": vision.vision_tp_sharded(deepstack=True),
        # the sparse layers' router (mlp.gate) and experts (mlp.experts) are not TP-sharded
        "llm": (
            "*.embed_tokens",
            "*.layers.*.self_attn.*_proj",
            "*.layers.*.mlp.gate_proj",
            "*.layers.*.mlp.up_proj",
            "*.layers.*.mlp.down_proj",
            "lm_head",
        ),
    },
)

MOE_EXTRA = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
    "norm_topk_prob",
)
LLM_EXTRA = ("head_dim", "hidden_act", "mrope_interleaved", "mrope_section", *MOE_EXTRA)


@dataclass(frozen=True)
class Numbers:
    """Every architecture number of a Qwen3-VL-MoE model, from the schema or from a transformers config."""

    vision: VisionNumbers
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int  # the dense layers' SwiGLU width (model.llm.intermediate_size)
    vocab: int
    tied: bool
    llm_act: str
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    experts: int
    top_k: int
    moe_mlp: int  # one expert's width (moe_intermediate_size)
    sparse_step: int
    mlp_only: tuple[int, ...]
    aux_coef: float
    norm_topk_prob: bool

    @property
    def q_dim(self) -> int:
        """Width of the query / attention output: ``heads * head_dim``."""
        return self.heads * self.head_dim

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` holds a router + experts (transformers' rule)."""
        return layer not in self.mlp_only and self.experts > 0 and (layer + 1) % self.sparse_step == 0

    @property
    def sparse_layers(self) -> int:
        """How many decoder layers are sparse-MoE."""
        return sum(1 for i in range(self.layers) if self.is_sparse(i))


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
        experts=int(te["num_experts"]),
        top_k=int(te["num_experts_per_tok"]),
        moe_mlp=int(te["moe_intermediate_size"]),
        sparse_step=int(te["decoder_sparse_step"]),
        mlp_only=tuple(int(i) for i in te["mlp_only_layers"]),
        aux_coef=float(te["router_aux_loss_coef"]),
        norm_topk_prob=bool(te["norm_topk_prob"]),
    )


# --- parameter counts ------------------------------------------------------------------------------
def _attention(n: Numbers) -> ParamCount:
    """q/k/v/o (no biases, TP-sharded), input + post-attention RMSNorm and q_norm/k_norm (replicated)."""
    kv = n.kv_heads * n.head_dim
    return ParamCount(
        tp_sharded=n.hidden * n.q_dim + 2 * n.hidden * kv + n.q_dim * n.hidden,
        replicated=2 * n.hidden + 2 * n.head_dim,
    )


def sparse_block(n: Numbers) -> ParamCount:
    """One sparse decoder layer: attention, the router [E, H] (replicated), the experts 3*E*I*H."""
    a = _attention(n)
    return ParamCount(
        tp_sharded=a.tp_sharded,
        replicated=a.replicated + n.experts * n.hidden,
        expert=3 * n.experts * n.moe_mlp * n.hidden,
    )


def dense_block(n: Numbers) -> ParamCount:
    """One dense decoder layer (``mlp_only_layers`` / off the sparse step): attention + SwiGLU of ``mlp``."""
    a = _attention(n)
    return ParamCount(tp_sharded=a.tp_sharded + 3 * n.hidden * n.mlp, replicated=a.replicated)


def llm_counts(n: Numbers) -> ParamCount:
    """Layers, embeddings, final norm and lm_head unless tied."""
    sparse, dense = n.sparse_layers, n.layers - n.sparse_layers
    s, d = sparse_block(n), dense_block(n)
    embeddings = n.vocab * n.hidden * (1 if n.tied else 2)
    return ParamCount(
        tp_sharded=sparse * s.tp_sharded + dense * d.tp_sharded + embeddings,
        replicated=sparse * s.replicated + dense * d.replicated + n.hidden,
        expert=sparse * s.expert,
    )


def module_counts(name: str, n: Numbers) -> ParamCount:
    """Parameters of module ``name`` (``vision`` or ``llm``), split TP-sharded / replicated / expert."""
    return vision.module_counts(n.vision) if name == "vision" else llm_counts(n)


def active_params(name: str, n: Numbers) -> int:
    """Parameters one token passes through: the module's total with ``top_k`` of ``E`` experts per
    sparse layer (the encoder and the dense parts count whole)."""
    total = module_counts(name, n)
    if name == "vision":
        return total.total
    return total.total - total.expert + n.sparse_layers * 3 * n.top_k * n.moe_mlp * n.hidden


def block_counts(name: str, n: Numbers) -> ParamCount:
    """Parameters of ONE block of module ``name``: the larger of a sparse and a dense layer for the LLM."""
    if name == "vision":
        return vision.block_counts(n.vision)
    kinds = [sparse_block(n)] if n.sparse_layers else []
    if n.sparse_layers < n.layers:
        kinds.append(dense_block(n))
    return max(kinds, key=lambda c: c.total)


def largest(name: str, n: Numbers) -> int:
    """Elements of the module's largest single parameter tensor (before TP/FSDP/EP sharding): for the
    LLM usually ``experts.gate_up_proj`` [E, 2I, H] (1.6e9 elements in the 235B)."""
    if name == "vision":
        return vision.largest(n.vision)
    sizes = [n.vocab * n.hidden, n.hidden * n.q_dim]
    if n.sparse_layers:
        sizes.append(n.experts * 2 * n.moe_mlp * n.hidden)
    if n.sparse_layers < n.layers:
        sizes.append(n.hidden * n.mlp)
    return max(sizes)


def _llm_mlp_width(n: Numbers) -> int:
    """The widest MLP one token passes through in one layer: ``top_k * I`` (sparse) or ``mlp`` (dense)."""
    widths = [n.top_k * n.moe_mlp] if n.sparse_layers else []
    if n.sparse_layers < n.layers:
        widths.append(n.mlp)
    return max(widths)


def _tp_input_grads(n: Numbers) -> int:
    """q, k, v; plus gate and up when a dense layer exists (a sparse MLP is replicated over TP, so its
    input gradient needs no all-reduce)."""
    return 3 if n.sparse_layers == n.layers else 5


def shape(name: str, n: Numbers) -> LayerShape:
    """Activation-relevant sizes of one block (the LLM's MLP width is the active one)."""
    if name == "vision":
        return vision.shape(n.vision)
    return LayerShape(
        hidden=n.hidden,
        mlp=_llm_mlp_width(n),
        kv_dim=n.kv_heads * n.head_dim,
        heads=n.heads,
        layers=n.layers,
        q_dim=n.q_dim,
        tp_input_grads=_tp_input_grads(n),
    )


# --- validation ------------------------------------------------------------------------------------
_LLM_SIZES = ["hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"]


def _validate_attention(n: Numbers, issues: Issues) -> None:
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


def _validate_moe(n: Numbers, issues: Issues) -> None:
    p = "model.llm.extra"
    issues.check(n.experts >= 1, f"{p}.num_experts", n.experts, "must be >= 1", "use the published 128")
    issues.check(
        1 <= n.top_k <= max(n.experts, 1),
        f"{p}.num_experts_per_tok",
        n.top_k,
        f"must be in [1, num_experts={n.experts}] (each token picks top-k distinct experts)",
        "use the published 8",
    )
    issues.check(
        n.moe_mlp >= 1, f"{p}.moe_intermediate_size", n.moe_mlp, "must be >= 1", "use e.g. the published 768"
    )
    issues.check(
        n.sparse_step >= 1,
        f"{p}.decoder_sparse_step",
        n.sparse_step,
        "must be >= 1 (layer i is sparse when (i + 1) % step == 0)",
        "use the published 1 (every layer sparse)",
    )
    bad = [i for i in n.mlp_only if not 0 <= i < n.layers]
    issues.check(
        not bad and len(set(n.mlp_only)) == len(n.mlp_only),
        f"{p}.mlp_only_layers",
        list(n.mlp_only),
        f"must be distinct decoder layer indexes in [0, num_layers={n.layers}) (out of range: {bad})",
        "use the published [] (no dense layers)",
    )
    issues.check(
        n.sparse_step < 1 or n.experts < 1 or n.sparse_layers >= 1,
        f"{p}.mlp_only_layers",
        list(n.mlp_only),
        f"with these and decoder_sparse_step={n.sparse_step} no decoder layer is sparse: a dense model",
        "train it with the qwen3_vl family, or leave at least one layer sparse",
    )
    issues.check(
        n.aux_coef >= 0,
        f"{p}.router_aux_loss_coef",
        n.aux_coef,
        "must be >= 0 (weight of the load-balancing loss added to the LM loss)",
        "use the published 0.001, or 0 to train without it",
    )
    issues.check(
        n.norm_topk_prob,
        f"{p}.norm_topk_prob",
        n.norm_topk_prob,
        "transformers' Qwen3-VL-MoE router always renormalises the top-k probabilities",
        "set it to true",
    )


def validate(model: Any, issues: Issues) -> None:
    """Add an issue for every number that does not build a Qwen3-VL-MoE model."""
    ok = vision.validate_sizes(model, issues, family=FAMILY_NAME, example=EXAMPLE, deepstack=True)
    issues.positive(model.llm, "model.llm", _LLM_SIZES)
    ok = check_extra_keys(model, "llm", LLM_EXTRA, issues, family=FAMILY_NAME, example=EXAMPLE) and ok
    if not ok or issues.items:
        return
    try:
        n = numbers(model)
    except (TypeError, ValueError) as e:
        issues.add(
            "model.llm.extra",
            {k: model.llm.extra[k] for k in MOE_EXTRA},
            f"the MoE numbers must be integers, a list of integers and a float ({e})",
            f"copy model.llm.extra from conf/model/{EXAMPLE}.yaml",
        )
        return
    vision.validate_numbers(n.vision, issues, llm_layers=n.layers)
    _validate_attention(n, issues)
    _validate_moe(n, issues)


# --- the typed architecture ------------------------------------------------------------------------
def llm_blocks(n: Numbers) -> tuple[Block, ...]:
    """Per decoder layer: causal GQA attention with ``head_dim`` per head, and either the sparse MLP
    (``Mlp(kind="moe")``: E experts of I, top-k active, no shared expert) or the dense SwiGLU."""
    attn = Attention(kind="full", heads=n.heads, kv_heads=n.kv_heads, head_dim=n.head_dim, causal=True, qk_norm=True)
    moe = Mlp(kind="moe", intermediate=n.moe_mlp, experts=n.experts, top_k=n.top_k)
    dense = Mlp(kind="dense", intermediate=n.mlp)
    return tuple(Block(attn, moe if n.is_sparse(i) else dense) for i in range(n.layers))


def llm_arch(n: Numbers) -> ModuleArch:
    """The MoE decoder; vocab-parallel lm_head. The router's ``E*H`` MACs per token and sparse layer are
    left out of ``block_macs`` (``E / (3 * top_k * I)`` of the experts': 2 % in the 30B-A3B)."""
    return ModuleArch(
        hidden=n.hidden,
        blocks=llm_blocks(n),
        params=llm_counts(n),
        block_params=block_counts("llm", n),
        largest_param=largest("llm", n),
        inputs=vision.edges(n.vision),
        head_macs=float(n.hidden * n.vocab),
        vocab=n.vocab,
        tp_input_grads=_tp_input_grads(n),
        tensors_per_block=11,  # 2 norms, q/k/v/o, q_norm, k_norm + router, gate_up, down (or gate/up/down)
        root_tensors=3,
    )


class Qwen3VLMoeArch:
    """:class:`dhp.models.arch.FamilyArch` of Qwen3-VL-MoE (reads ``model.vision.extra`` / ``model.llm.extra``)."""

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

    def active_params(self, name: str, model: Any) -> int:
        """Parameters one token passes through (top-k of E experts per sparse layer)."""
        return active_params(name, numbers(model))

    def layer_params(self, name: str, model: Any) -> ParamCount:
        return block_counts(name, numbers(model))

    def largest_param(self, name: str, model: Any) -> int:
        return largest(name, numbers(model))

    def layer_shape(self, name: str, model: Any) -> LayerShape:
        return shape(name, numbers(model))

    def module_axes(self, name: str, model: Any) -> ModuleAxes:
        """Encoder: TP (heads, merger width) and Ulysses SP (heads). LLM: TP on attention (and on the
        dense layers' MLP, if any), no sequence parallelism inside TP (DeepStack needs the whole
        sequence); the experts are split by EP (its degree must divide ``num_experts``, which the
        typed architecture's ``Mlp(kind="moe")`` blocks carry)."""
        n = numbers(model)
        if name == "vision":
            return vision.vision_axes(n.vision)
        divides = {
            "model.llm.num_heads": n.heads,
            "model.llm.num_kv_heads": n.kv_heads,
            "model.llm.vocab_size": n.vocab,
        }
        if n.sparse_layers < n.layers:
            divides["model.llm.intermediate_size"] = n.mlp
        return ModuleAxes(tp=True, sp=False, tp_sequence_parallel=False, tp_divides=divides)


ARCH = Qwen3VLMoeArch()
