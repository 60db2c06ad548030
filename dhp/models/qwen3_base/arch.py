"""What every Qwen3-style family's architecture shares, without torch: numbers, checks, the typed decoder.

A Qwen3-style family (Qwen3-VL, Qwen3.5) is the Qwen3 vision encoder (``dhp/models/qwen3_vision``)
feeding a Qwen3 decoder: GQA attention with its own ``head_dim`` and per-head q/k RMSNorms, interleaved
M-RoPE, per layer a SwiGLU MLP or a sparse-MoE block (a top-k router [E, H] and E routed SwiGLU experts
held as 3-D tensors), vocab-parallel embeddings and lm_head. Each family has a dense and an MoE flavour
(:class:`Flavour`), told apart by ``model.llm.extra.num_experts`` (or by a flavour's own family name).

:class:`Qwen3Arch` implements :class:`dhp.models.arch.FamilyArch` (validation, the typed architecture,
the parallel axes) over what a family declares: its :class:`TextNumbers` subclass (read from the schema
and from a transformers config), its decoder's typed blocks and per-layer counts, its LLM's axes and its
own checks. The helpers below count what every Qwen3 decoder layer has (:func:`attention_params`,
:func:`mlp_params`) and assemble the module (:func:`decoder_arch`, :func:`decoder_axes`).

Parameter counts follow transformers' modeling code exactly (each family's unit test builds the modules
on meta and compares). ``tp_sharded`` parameters are divided by TP, ``replicated`` ones are whole on every
TP rank, ``expert`` ones are divided by EP (whole on every TP rank: no expert TP).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dhp.config.issues import Issues
from dhp.config.plan_space import with_experts
from dhp.models import arch
from dhp.models.arch import Architecture, Attention, Block, Mlp, ModuleArch, ModuleAxes, ParamCount
from dhp.models.qwen3_vision import arch as vision
from dhp.models.qwen3_vision.arch import VisionNumbers, check_extra_keys

#: the MoE flavour's ``model.llm.extra`` keys every Qwen3-style family has
MOE_EXTRA = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "router_aux_loss_coef")


@dataclass(frozen=True)
class Flavour:
    """One flavour of a family: ``name`` is its transformers ``model_type`` (and a family name that
    selects this flavour alone), ``example`` the ``conf/model`` entry a validation message points at."""

    name: str
    example: str

    @property
    def tiny(self) -> str:
        """The ``conf/model`` entry of its tiny test model."""
        return f"tiny_{self.name}"


@dataclass(frozen=True, kw_only=True)
class TextNumbers:
    """The numbers every Qwen3-style model has; a family's ``Numbers`` adds its own (and ``layers``).
    The MoE numbers are 0 in the dense flavour."""

    vision: VisionNumbers
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int  # the dense SwiGLU's width (the shared expert's in an MoE block that has one)
    vocab: int
    tied: bool
    llm_act: str
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    experts: int = 0  # routed experts per sparse layer (0: the dense flavour)
    top_k: int = 0
    moe_mlp: int = 0  # one routed expert's width
    aux_coef: float = 0.0  # weight of the load-balancing loss added to the LM loss

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def q_dim(self) -> int:
        """Width of the attention output: ``heads * head_dim`` (not ``hidden`` in general)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Rotary channels per head (all of ``head_dim`` unless the family rotates fewer)."""
        return self.head_dim


def is_moe(model: Any) -> bool:
    """Whether a schema ``model`` block declares the MoE flavour (``model.llm.extra.num_experts``)."""
    return "extra" in model.llm and "num_experts" in model.llm.extra


def text_numbers(model: Any, *, deepstack: bool) -> dict[str, Any]:
    """The :class:`TextNumbers` fields of a schema ``model`` block (``extra`` keys validated first)."""
    t, te = model.llm, model.llm.extra
    out: dict[str, Any] = dict(
        vision=vision.vision_numbers(model.vision, out_hidden=t.hidden_size, deepstack=deepstack),
        hidden=t.hidden_size,
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
    if is_moe(model):
        out.update(
            experts=int(te["num_experts"]),
            top_k=int(te["num_experts_per_tok"]),
            moe_mlp=int(te["moe_intermediate_size"]),
            aux_coef=float(te["router_aux_loss_coef"]),
        )
    return out


# --- parameter counts of one decoder layer ---------------------------------------------------------
def attention_params(n: TextNumbers, *, gated: bool = False) -> ParamCount:
    """q (and, ``gated``, an output gate as wide), k, v, o (no biases, TP-sharded) and q_norm / k_norm
    over ``head_dim`` (replicated)."""
    q = n.q_dim * (2 if gated else 1)
    return ParamCount(
        tp_sharded=n.hidden * q + 2 * n.hidden * n.kv_dim + n.q_dim * n.hidden, replicated=2 * n.head_dim
    )


def mlp_params(n: TextNumbers, *, sparse: bool, shared: bool = False) -> ParamCount:
    """The layer's two RMSNorms (replicated) and its MLP: the dense SwiGLU of ``mlp`` (TP-sharded), or
    the sparse block: the router E x H (replicated), the routed experts 3*E*I*H (``expert``) and, with
    ``shared``, a shared SwiGLU expert of ``mlp`` (TP-sharded) with its sigmoid gate H -> 1 (replicated)."""
    h, norms = n.hidden, 2 * n.hidden
    if not sparse:
        return ParamCount(tp_sharded=3 * h * n.mlp, replicated=norms)
    return ParamCount(
        tp_sharded=3 * h * n.mlp if shared else 0,
        replicated=norms + n.experts * h + (h if shared else 0),
        expert=3 * n.experts * n.moe_mlp * h,
    )


# --- the typed decoder -----------------------------------------------------------------------------
def full_attention(n: TextNumbers) -> Attention:
    """Causal GQA attention with ``head_dim`` per head and Qwen3's per-head q/k RMSNorms."""
    return Attention(
        kind="full", heads=n.heads, kv_heads=n.kv_heads, head_dim=n.head_dim, causal=True, qk_norm=True
    )


def dense_mlp(n: TextNumbers) -> Mlp:
    return Mlp(kind="dense", intermediate=n.mlp)


def moe_mlp(n: TextNumbers, *, shared: int = 0) -> Mlp:
    """E routed experts of ``moe_mlp``, top-k active, plus a ``shared`` always-on expert width."""
    return Mlp(kind="moe", intermediate=n.moe_mlp, experts=n.experts, top_k=n.top_k, shared=shared)


def decoder_arch(
    n: TextNumbers,
    *,
    blocks: tuple[Block, ...],
    layer_params: Sequence[ParamCount],
    largest: Iterable[int],
    tp_input_grads: int,
    tensors_per_block: int,
) -> ModuleArch:
    """The LLM module: ``blocks`` with one :class:`ParamCount` per layer, vocab-parallel embeddings and
    lm_head (unless tied), the final norm; it takes every edge of the encoder and computes the loss.
    ``largest``: the sizes of the layers' largest tensors (the embedding table is added)."""
    embeddings = n.vocab * n.hidden * (1 if n.tied else 2)
    return ModuleArch(
        hidden=n.hidden,
        blocks=blocks,
        params=ParamCount(
            tp_sharded=sum(c.tp_sharded for c in layer_params) + embeddings,
            replicated=sum(c.replicated for c in layer_params) + n.hidden,
            expert=sum(c.expert for c in layer_params),
        ),
        block_params=max(layer_params, key=lambda c: c.total),
        largest_param=max(n.vocab * n.hidden, *largest),
        inputs=vision.edges(n.vision),
        head_macs=float(n.hidden * n.vocab),
        vocab=n.vocab,
        tp_input_grads=tp_input_grads,
        tensors_per_block=tensors_per_block,
        root_tensors=3,  # embed_tokens, the final norm, lm_head
    )


def decoder_axes(
    n: TextNumbers,
    *,
    sequence_parallel: bool,
    mlp: bool = True,
    heads: Mapping[str, int] | None = None,
    context_parallel: bool = False,
    cp_divides: Mapping[str, int] | None = None,
) -> ModuleAxes:
    """The LLM's axes (``dhp.models.arch.decoder_axes``): TP over the attention heads, KV heads,
    ``heads`` (a family's other head groups), the vocabulary and (``mlp``) the SwiGLU width; context
    parallelism where the decoder's every layer is attention (``context_parallel``); pipeline stages
    over its ``n.layers`` decoder layers."""
    return arch.decoder_axes(
        heads=n.heads,
        kv_heads=n.kv_heads,
        vocab=n.vocab,
        mlp=n.mlp if mlp else None,
        sequence_parallel=sequence_parallel,
        head_groups=heads,
        context_parallel=context_parallel,
        cp_divides=cp_divides,
        pipeline=True,
        layers=n.layers,
        tied=n.tied,
    )


# --- the family's architecture ---------------------------------------------------------------------
class Qwen3Arch:
    """:class:`dhp.models.arch.FamilyArch` of a Qwen3-style family; the family subclasses it and
    declares ``dense`` / ``moe`` (:class:`Flavour`), ``display`` (its name in messages),
    ``capabilities``, ``deepstack`` (whether its encoder has DeepStack mergers), ``llm_extra`` (its
    dense flavour's ``model.llm.extra`` keys) and ``moe_extra``, ``mrope_rule`` (the M-RoPE sum's words
    and published example), and writes the hooks :meth:`numbers`, :meth:`numbers_from_hf`,
    :meth:`llm_arch`, :meth:`llm_axes` (and, for its own numbers, :meth:`check_raw` /
    :meth:`check_numbers`)."""

    module_names: tuple[str, ...] = ("vision", "llm")  # producers first

    dense: Flavour
    moe: Flavour
    display: str
    capabilities: arch.Capabilities
    deepstack: bool
    llm_extra: tuple[str, ...]
    moe_extra: tuple[str, ...] = MOE_EXTRA
    mrope_rule: tuple[str, str] = ("head_dim", "use the published [24, 20, 20] for head_dim 128")

    # --- hooks ---------------------------------------------------------------------------------
    def numbers(self, model: Any) -> TextNumbers:
        """The family's numbers of a schema ``model`` block (validated)."""
        raise NotImplementedError

    def numbers_from_hf(self, cfg: Any) -> TextNumbers:
        """The family's numbers of a transformers config (a HF directory's ``config.json``)."""
        raise NotImplementedError

    def llm_arch(self, n: Any) -> ModuleArch:
        """The typed decoder (:func:`decoder_arch`)."""
        raise NotImplementedError

    def llm_axes(self, n: Any) -> ModuleAxes:
        """The decoder's parallel axes (:func:`decoder_axes`)."""
        raise NotImplementedError

    def check_raw(self, model: Any, issues: Issues) -> None:
        """The family's own ``extra`` values that must be valid before :meth:`numbers` can read them."""

    def check_numbers(self, n: Any, issues: Issues) -> None:
        """The family's own checks of its numbers."""

    # --- FamilyArch ----------------------------------------------------------------------------
    def flavour(self, model: Any) -> Flavour:
        """The MoE flavour when ``model.llm.extra`` declares experts or ``model.family`` names it."""
        return self.moe if is_moe(model) or model.family == self.moe.name else self.dense

    def validate(self, model: Any, issues: Issues) -> None:
        """Add an issue for every number that does not build this family's model."""
        flavour = self.flavour(model)
        moe = flavour == self.moe
        named = dict(family=model.family, example=flavour.example)
        ok = vision.validate_sizes(model, issues, **named, deepstack=self.deepstack)
        issues.positive(model.llm, "model.llm", list(arch.LLM_SIZES))
        keys = self.llm_extra + (self.moe_extra if moe else ())
        ok = check_extra_keys(model, "llm", keys, issues, **named) and ok
        if not ok or issues.items:
            return
        self.check_raw(model, issues)
        if moe:
            _check_moe_raw(model.llm.extra, issues, example=flavour.example)
        if issues.items:
            return
        n = self.numbers(model)
        vision.validate_numbers(n.vision, issues, llm_layers=n.layers)
        self._check_attention(n, issues)
        if moe:
            _check_moe(n, issues)
        self.check_numbers(n, issues)

    def _check_attention(self, n: TextNumbers, issues: Issues) -> None:
        words, fix = self.mrope_rule
        issues.check(
            n.heads % n.kv_heads == 0,
            "model.llm.num_kv_heads",
            n.kv_heads,
            f"must divide model.llm.num_heads={n.heads} (grouped-query attention)",
            "pick a divisor",
        )
        issues.check(
            len(n.mrope_section) == 3 and 2 * sum(n.mrope_section) == n.rotary_dim,
            "model.llm.extra.mrope_section",
            list(n.mrope_section),
            f"must be 3 numbers summing to {words} / 2 = {n.rotary_dim // 2}",
            fix,
        )
        issues.check(
            n.mrope_interleaved,
            "model.llm.extra.mrope_interleaved",
            n.mrope_interleaved,
            f"{self.display}'s rotary embedding is always interleaved",
            "set it to true",
        )

    def architecture(self, model: Any) -> Architecture:
        return self.architecture_of(self.numbers(model))

    def architecture_of(self, n: TextNumbers) -> Architecture:
        """The typed architecture of numbers (from the schema or from a transformers config)."""
        return Architecture(
            modules={"vision": vision.vision_arch(n.vision), "llm": self.llm_arch(n)},
            capabilities=self.capabilities,
        )

    def module_axes(self, name: str, model: Any) -> ModuleAxes:
        return self.axes_of(name, self.numbers(model))

    def axes_of(self, name: str, n: TextNumbers) -> ModuleAxes:
        """Module ``name``'s axes of numbers: the encoder's (TP, Ulysses SP) or the decoder's, with the
        expert count of its MoE blocks (what every ep degree must divide)."""
        if name == "vision":
            return vision.vision_axes(n.vision)
        return with_experts(self.llm_axes(n), self.llm_arch(n).blocks)


def _check_moe_raw(te: Any, issues: Issues, *, example: str) -> None:
    """The MoE numbers' types: positive integers E, top-k and the expert width, a number for the weight."""
    check_positive_ints(
        te, ("num_experts", "num_experts_per_tok", "moe_intermediate_size"), issues, example=example
    )
    coef = te["router_aux_loss_coef"]
    issues.check(
        isinstance(coef, (int, float)) and not isinstance(coef, bool),
        "model.llm.extra.router_aux_loss_coef",
        coef,
        "must be a number (weight of the load-balancing loss added to the LM loss)",
        "use the published 0.001, or 0 to train without it",
    )


def _check_moe(n: TextNumbers, issues: Issues) -> None:
    """1 <= top-k <= E, and a load-balancing weight >= 0."""
    issues.check(
        n.top_k <= n.experts,
        "model.llm.extra.num_experts_per_tok",
        n.top_k,
        f"must be <= num_experts={n.experts} (each token picks top-k distinct experts)",
        "use the published 8",
    )
    issues.check(
        n.aux_coef >= 0,
        "model.llm.extra.router_aux_loss_coef",
        n.aux_coef,
        "must be >= 0 (weight of the load-balancing loss added to the LM loss)",
        "use the published 0.001, or 0 to train without it",
    )


def positive_int(value: Any) -> bool:
    """An ``int`` (not a ``bool``) above 0."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_positive_ints(extra: Any, keys: Iterable[str], issues: Issues, *, example: str) -> None:
    """Each ``model.llm.extra[key]`` (``extra``) is a positive integer."""
    for key in keys:
        issues.check(
            positive_int(extra[key]),
            f"model.llm.extra.{key}",
            extra[key],
            "must be a positive integer",
            f"copy it from conf/model/{example}.yaml",
        )
