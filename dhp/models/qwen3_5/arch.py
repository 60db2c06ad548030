"""Qwen3.5's architecture numbers without torch: validation, typed hybrid blocks, parameter counts (``ARCH``).

Qwen3.5 is the Qwen3 vision encoder without DeepStack (``dhp/models/qwen3_vision/arch.py``, K = 0)
feeding a hybrid LLM: ``layer_types`` repeats ``full_attention_interval - 1`` Gated DeltaNet layers
(linear attention: a recurrent state of ``key_head_dim x value_head_dim`` per value head, a short causal
conv1d over q/k/v) and one gated full-attention layer (GQA with a sigmoid output gate from a second
half of q_proj, per-head q/k RMSNorms, partial interleaved M-RoPE). Every layer has a SwiGLU MLP.

``model.llm.extra`` carries Qwen3.5's own numbers and is checked here: ``head_dim``, ``hidden_act``,
``mrope_section``, ``mrope_interleaved``, ``partial_rotary_factor`` (rotary on that fraction of
head_dim), ``full_attention_interval``, ``linear_num_key_heads``, ``linear_num_value_heads``,
``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_conv_kernel_dim``.

The MoE flavour (Qwen3.5-35B-A3B and larger) is the same hybrid LLM with every layer's MLP a sparse MoE
block: a top-k router [E, H], E routed SwiGLU experts of ``moe_intermediate_size`` (transformers holds
them as two 3-D tensors ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I]) and one
always-on shared SwiGLU expert of ``model.llm.intermediate_size`` scaled by a sigmoid gate (a Linear
H -> 1). It is declared by the extra keys ``num_experts``, ``num_experts_per_tok``,
``moe_intermediate_size`` and ``router_aux_loss_coef`` (all four, or none for the dense flavour).

Parameter counts follow transformers' ``modeling_qwen3_5`` exactly (a unit test builds the modules on the
meta device and compares). ``tp_sharded`` parameters are divided by the TP degree, ``replicated`` ones
are whole on every TP rank:

- full-attention layer: q h->2*heads*head_dim (query + output gate), k/v h->kv_heads*head_dim, o
  heads*head_dim->h (no biases, all sharded); q_norm/k_norm over head_dim (replicated);
- Gated DeltaNet layer: in_proj_qkv h->2*Kd+Vd, in_proj_z h->Vd, in_proj_b/in_proj_a h->Hv, depthwise
  conv1d over the 2*Kd+Vd channels (kernel k, no bias), dt_bias and A_log (Hv each), out_proj Vd->h
  (Kd = Hk*dk, Vd = Hv*dv): all split by head group under TP; the gated RMSNorm's weight (dv, shared by
  every head) is replicated;
- every layer: RMSNorm x2 (replicated), SwiGLU gate/up h->m, down m->h (sharded); vocab-parallel
  embeddings and lm_head, the final norm replicated.
- MoE flavour, every layer: the shared expert h->m->h (sharded, as the dense MLP), its gate h->1 and the
  router E x h (replicated), the routed experts 3*E*I*h (``expert``: split over EP ranks, whole on every
  TP rank). Active parameters count top-k of the E experts: :func:`active_params`.
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

FAMILY = "qwen3_5"
EXAMPLE = "qwen3_5_27b"
LINEAR, FULL = "linear_attention", "full_attention"

#: What this family's runtime does exactly. Packing and video are not declared: the LLM's M-RoPE
#: positions have no per-sample (packed) path and no video parity test, so validation refuses
#: ``data.packing`` and video data for this family.
CAPABILITIES = Capabilities(
    packing=False,
    video=False,
    tp_sharded={
        "vision": vision.vision_tp_sharded(deepstack=False),
        "llm": (
            "*.embed_tokens",
            "*.layers.*.self_attn.*_proj",
            "*.layers.*.linear_attn.in_proj_*",
            "*.layers.*.linear_attn.conv1d",
            "*.layers.*.linear_attn.dt_bias",
            "*.layers.*.linear_attn.A_log",
            "*.layers.*.linear_attn.out_proj",
            "*.layers.*.mlp.gate_proj",
            "*.layers.*.mlp.up_proj",
            "*.layers.*.mlp.down_proj",
            "*.layers.*.mlp.shared_expert.*",  # MoE flavour; its gate, router and experts are not TP-sharded
            "lm_head",
        ),
    },
)

LLM_EXTRA = (
    "head_dim",
    "hidden_act",
    "mrope_section",
    "mrope_interleaved",
    "partial_rotary_factor",
    "full_attention_interval",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
#: the MoE flavour's extra keys (all present, or none for the dense flavour)
MOE_EXTRA = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "router_aux_loss_coef")
MOE_EXAMPLE = "qwen3_5_35b_a3b"


def is_moe(model: Any) -> bool:
    """Whether a schema ``model`` block declares the MoE flavour (``model.llm.extra.num_experts``)."""
    return "extra" in model.llm and "num_experts" in model.llm.extra


def layer_types_of(layers: int, interval: int) -> tuple[str, ...]:
    """transformers' pattern: layer i is full attention when ``(i + 1) % interval == 0``, else linear."""
    return tuple(LINEAR if (i + 1) % interval else FULL for i in range(layers))


@dataclass(frozen=True)
class Numbers:
    """Every architecture number of a Qwen3.5 (dense) model, from the schema or a transformers config."""

    vision: VisionNumbers
    hidden: int
    layer_types: tuple[str, ...]
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    tied: bool
    llm_act: str
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    partial_rotary_factor: float
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    conv_kernel: int
    experts: int = 0  # MoE flavour: routed experts per layer (0: the dense flavour)
    top_k: int = 0
    moe_mlp: int = 0  # one routed expert's width; the shared expert's is ``mlp``
    aux_coef: float = 0.0

    @property
    def moe(self) -> bool:
        """Whether every layer's MLP is a sparse MoE block (router, experts, gated shared expert)."""
        return self.experts > 0

    @property
    def layers(self) -> int:
        return len(self.layer_types)

    @property
    def q_dim(self) -> int:
        """Width of the attention output: ``heads * head_dim`` (q_proj emits twice that: query + gate)."""
        return self.heads * self.head_dim

    @property
    def key_dim(self) -> int:
        """DeltaNet q/k width: ``linear_num_key_heads * linear_key_head_dim``."""
        return self.linear_k_heads * self.linear_k_dim

    @property
    def value_dim(self) -> int:
        """DeltaNet v / output width: ``linear_num_value_heads * linear_value_head_dim``."""
        return self.linear_v_heads * self.linear_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv1d (q, k, v together)."""
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        """Rotary channels per head: ``head_dim * partial_rotary_factor``."""
        return int(self.head_dim * self.partial_rotary_factor)


def numbers(model: Any) -> Numbers:
    """The numbers of a schema ``model`` block (DictConfig or dataclass; ``extra`` keys validated first)."""
    t = model.llm
    te = t.extra
    return Numbers(
        vision=vision.vision_numbers(model.vision, out_hidden=t.hidden_size, deepstack=False),
        hidden=t.hidden_size,
        layer_types=layer_types_of(t.num_layers, int(te["full_attention_interval"])),
        heads=t.num_heads,
        kv_heads=t.num_kv_heads,
        head_dim=te["head_dim"],
        mlp=t.intermediate_size,
        vocab=t.vocab_size,
        tied=bool(t.tie_word_embeddings),
        llm_act=te["hidden_act"],
        mrope_section=tuple(te["mrope_section"]),
        mrope_interleaved=bool(te["mrope_interleaved"]),
        partial_rotary_factor=float(te["partial_rotary_factor"]),
        rope_theta=float(t.rope_theta),
        rms_norm_eps=float(t.rms_norm_eps),
        max_position_embeddings=t.max_position_embeddings,
        linear_k_heads=te["linear_num_key_heads"],
        linear_v_heads=te["linear_num_value_heads"],
        linear_k_dim=te["linear_key_head_dim"],
        linear_v_dim=te["linear_value_head_dim"],
        conv_kernel=te["linear_conv_kernel_dim"],
        **(
            dict(
                experts=int(te["num_experts"]),
                top_k=int(te["num_experts_per_tok"]),
                moe_mlp=int(te["moe_intermediate_size"]),
                aux_coef=float(te["router_aux_loss_coef"]),
            )
            if is_moe(model)
            else {}
        ),
    )


# --- parameter counts ------------------------------------------------------------------------------
def _mlp_and_norms(n: Numbers) -> ParamCount:
    """The two RMSNorms and the SwiGLU of ``mlp`` (dense flavour) or the MoE block (shared expert of
    ``mlp`` TP-sharded; its gate h->1 and the router E x h replicated; the routed experts 3*E*I*h)."""
    if not n.moe:
        return ParamCount(tp_sharded=3 * n.hidden * n.mlp, replicated=2 * n.hidden)
    return ParamCount(
        tp_sharded=3 * n.hidden * n.mlp,
        replicated=2 * n.hidden + n.hidden + n.experts * n.hidden,
        expert=3 * n.experts * n.moe_mlp * n.hidden,
    )


def full_layer(n: Numbers) -> ParamCount:
    """One gated full-attention decoder layer (an FSDP unit)."""
    h, kv = n.hidden, n.kv_heads * n.head_dim
    base = _mlp_and_norms(n)
    return ParamCount(
        tp_sharded=base.tp_sharded + h * 2 * n.q_dim + 2 * h * kv + n.q_dim * h,
        replicated=base.replicated + 2 * n.head_dim,
        expert=base.expert,
    )


def linear_layer(n: Numbers) -> ParamCount:
    """One Gated DeltaNet decoder layer (an FSDP unit)."""
    h, hv = n.hidden, n.linear_v_heads
    base = _mlp_and_norms(n)
    projections = h * n.conv_dim + h * n.value_dim + 2 * h * hv + n.value_dim * h
    return ParamCount(
        tp_sharded=base.tp_sharded + projections + n.conv_dim * n.conv_kernel + 2 * hv,
        replicated=base.replicated + n.linear_v_dim,
        expert=base.expert,
    )


def layer_counts(n: Numbers, kind: str) -> ParamCount:
    """One decoder layer of ``kind`` (``linear_attention`` / ``full_attention``)."""
    return linear_layer(n) if kind == LINEAR else full_layer(n)


def module_counts(name: str, n: Numbers) -> ParamCount:
    """``vision``: the shared encoder (no DeepStack); ``llm``: every layer by its kind, embeddings,
    final norm and lm_head unless tied."""
    if name == "vision":
        return vision.module_counts(n.vision)
    layers = [layer_counts(n, kind) for kind in n.layer_types]
    embeddings = n.vocab * n.hidden * (1 if n.tied else 2)
    return ParamCount(
        tp_sharded=sum(c.tp_sharded for c in layers) + embeddings,
        replicated=sum(c.replicated for c in layers) + n.hidden,
        expert=sum(c.expert for c in layers),
    )


def active_params(name: str, n: Numbers) -> int:
    """Parameters one token passes through: the module's total with ``top_k`` of the ``E`` routed experts
    of every layer (the encoder, the shared expert and everything dense count whole)."""
    total = module_counts(name, n)
    if name == "vision" or not n.moe:
        return total.total
    return total.total - total.expert + n.layers * 3 * n.top_k * n.moe_mlp * n.hidden


def block_counts(name: str, n: Numbers) -> ParamCount:
    """Parameters of the largest ONE block of module ``name`` (the FSDP unit that all-gathers most)."""
    if name == "vision":
        return vision.block_counts(n.vision)
    return max((layer_counts(n, kind) for kind in set(n.layer_types)), key=lambda c: c.total)


def largest(name: str, n: Numbers) -> int:
    """Elements of the module's largest single parameter tensor (before TP/FSDP sharding)."""
    if name == "vision":
        return vision.largest(n.vision)
    sizes = [n.vocab * n.hidden, n.hidden * n.mlp]
    if n.moe:
        sizes.append(n.experts * 2 * n.moe_mlp * n.hidden)  # experts.gate_up_proj [E, 2I, H]
    if FULL in n.layer_types:
        sizes.append(n.hidden * 2 * n.q_dim)
    if LINEAR in n.layer_types:
        sizes += [n.hidden * n.conv_dim, n.hidden * n.value_dim]
    return max(sizes)


def shape(name: str, n: Numbers) -> LayerShape:
    """Activation-relevant sizes of one LLM block: the full-attention layer's (GQA, ``head_dim``)."""
    if name == "vision":
        return vision.shape(n.vision)
    return LayerShape(
        hidden=n.hidden,
        mlp=n.top_k * n.moe_mlp + n.mlp if n.moe else n.mlp,  # the active width (routed + shared)
        kv_dim=n.kv_heads * n.head_dim,
        heads=n.heads,
        layers=n.layers,
        q_dim=n.q_dim,
    )


# --- validation ------------------------------------------------------------------------------------
_LLM_SIZES = ["hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"]
_LINEAR_SIZES = (
    "full_attention_interval",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "head_dim",
)


def validate(model: Any, issues: Issues) -> None:
    """Add an issue for every number that does not build a Qwen3.5 model."""
    ok = vision.validate_sizes(model, issues, family=FAMILY, example=EXAMPLE, deepstack=False)
    issues.positive(model.llm, "model.llm", _LLM_SIZES)
    moe = is_moe(model)
    keys, example = (LLM_EXTRA + MOE_EXTRA, MOE_EXAMPLE) if moe else (LLM_EXTRA, EXAMPLE)
    ok = check_extra_keys(model, "llm", keys, issues, family=FAMILY, example=example) and ok
    if not ok or issues.items:
        return
    for key in _LINEAR_SIZES:
        value = model.llm.extra[key]
        issues.check(
            isinstance(value, int) and value > 0,
            f"model.llm.extra.{key}",
            value,
            "must be a positive integer",
            f"copy it from conf/model/{EXAMPLE}.yaml",
        )
    if moe:
        _validate_moe_keys(model, issues)
    if issues.items:
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
        n.linear_v_heads % n.linear_k_heads == 0,
        "model.llm.extra.linear_num_key_heads",
        n.linear_k_heads,
        f"must divide linear_num_value_heads={n.linear_v_heads} (each key head serves a group of value heads)",
        "use the published 16 key heads for 48 value heads",
    )
    issues.check(
        0.0 < n.partial_rotary_factor <= 1.0 and n.rotary_dim % 2 == 0,
        "model.llm.extra.partial_rotary_factor",
        n.partial_rotary_factor,
        f"must be in (0, 1] and give an even rotary width (head_dim={n.head_dim})",
        "use the published 0.25",
    )
    issues.check(
        len(n.mrope_section) == 3 and 2 * sum(n.mrope_section) == n.rotary_dim,
        "model.llm.extra.mrope_section",
        list(n.mrope_section),
        f"must be 3 numbers summing to head_dim * partial_rotary_factor / 2 = {n.rotary_dim // 2}",
        "use the published [11, 11, 10] for head_dim 256 and factor 0.25",
    )
    issues.check(
        n.mrope_interleaved,
        "model.llm.extra.mrope_interleaved",
        n.mrope_interleaved,
        "Qwen3.5's rotary embedding is always interleaved",
        "set it to true",
    )
    interval = int(model.llm.extra["full_attention_interval"])
    issues.check(
        interval <= n.layers,
        "model.llm.extra.full_attention_interval",
        interval,
        f"must be <= model.llm.num_layers={n.layers} (layer interval-1 is the first full-attention layer)",
        "use the published 4",
    )


def _validate_moe_keys(model: Any, issues: Issues) -> None:
    """The MoE flavour's numbers: E >= 1 experts, 1 <= top-k <= E, a positive expert width, coef >= 0."""
    te, p = model.llm.extra, "model.llm.extra"
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        issues.check(
            isinstance(te[key], int) and te[key] > 0,
            f"{p}.{key}",
            te[key],
            "must be a positive integer",
            f"copy it from conf/model/{MOE_EXAMPLE}.yaml",
        )
    experts, top_k = te["num_experts"], te["num_experts_per_tok"]
    if isinstance(experts, int) and isinstance(top_k, int):
        issues.check(
            top_k <= experts,
            f"{p}.num_experts_per_tok",
            top_k,
            f"must be <= num_experts={experts} (each token picks top-k distinct experts)",
            "use the published 8",
        )
    coef = te["router_aux_loss_coef"]
    issues.check(
        isinstance(coef, (int, float)) and not isinstance(coef, bool) and coef >= 0,
        f"{p}.router_aux_loss_coef",
        coef,
        "must be a number >= 0 (weight of the load-balancing loss added to the LM loss)",
        "use the published 0.001, or 0 to train without it",
    )


# --- typed architecture ----------------------------------------------------------------------------
def llm_blocks(n: Numbers) -> tuple[Block, ...]:
    """Each decoder layer's token mixer by ``layer_types``: Gated DeltaNet (``linear``, value heads,
    key heads, value head width, state dk x dv per head) or causal gated GQA (``full``); the MLP is the
    dense SwiGLU, or in the MoE flavour ``Mlp(kind="moe")``: E experts of I, top-k active, plus the
    shared expert's width."""
    mlp = (
        Mlp(kind="moe", intermediate=n.moe_mlp, experts=n.experts, top_k=n.top_k, shared=n.mlp)
        if n.moe
        else Mlp(kind="dense", intermediate=n.mlp)
    )
    full = Attention(kind="full", heads=n.heads, kv_heads=n.kv_heads, head_dim=n.head_dim, causal=True, qk_norm=True)
    linear = Attention(
        kind="linear",
        heads=n.linear_v_heads,
        kv_heads=n.linear_k_heads,
        head_dim=n.linear_v_dim,
        state=n.linear_k_dim * n.linear_v_dim,
        causal=True,
    )
    return tuple(Block(linear if kind == LINEAR else full, mlp) for kind in n.layer_types)


def llm_arch(n: Numbers) -> ModuleArch:
    """The hybrid decoder: per-layer attention kinds, a SwiGLU MLP everywhere; vocab-parallel lm_head."""
    return ModuleArch(
        hidden=n.hidden,
        blocks=llm_blocks(n),
        params=module_counts("llm", n),
        block_params=block_counts("llm", n),
        largest_param=largest("llm", n),
        inputs=vision.edges(n.vision),
        head_macs=float(n.hidden * n.vocab),
        vocab=n.vocab,
        tp_input_grads=5,  # full: q, k, v, gate, up; DeltaNet: qkv, z, b, a (+ gate, up) counted alike
        # full: 2 norms, q/k/v/o, q_norm, k_norm, gate/up/down (DeltaNet: 12; MoE: + router, shared
        # expert gate, gate_up, down)
        tensors_per_block=15 if n.moe else 11,
        root_tensors=3,
    )


class Qwen3_5Arch:
    """:class:`dhp.models.arch.FamilyArch` of Qwen3.5 (reads ``model.vision.extra`` / ``model.llm.extra``)."""

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
        """Encoder: the shared Qwen3 encoder's TP and Ulysses SP. LLM: see :func:`llm_axes`."""
        n = numbers(model)
        return vision.vision_axes(n.vision) if name == "vision" else llm_axes(n)


def llm_axes(n: Numbers) -> ModuleAxes:
    """LLM: TP over the gated-attention heads, the Gated DeltaNet key/value head groups, the vocabulary
    and the MLP (or shared expert) width, with Megatron sequence parallelism inside TP in the dense
    flavour only (an MoE block adds the routed experts' whole-sequence output to the shared expert's);
    no Ulysses SP (the DeltaNet recurrence runs along the whole sequence)."""
    return ModuleAxes(
        tp=True,
        sp=False,
        tp_sequence_parallel=not n.moe,
        tp_divides={
            "model.llm.num_heads": n.heads,
            "model.llm.num_kv_heads": n.kv_heads,
            "model.llm.extra.linear_num_key_heads": n.linear_k_heads,
            "model.llm.extra.linear_num_value_heads": n.linear_v_heads,
            "model.llm.vocab_size": n.vocab,
            "model.llm.intermediate_size": n.mlp,
        },
    )


ARCH = Qwen3_5Arch()
