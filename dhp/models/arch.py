"""What the generic layers know about a model family, without torch: its typed architecture.

A family's ``arch.py`` exposes ``ARCH``, an object with the :class:`FamilyArch` methods. They read
the run's architecture numbers (``model.vision`` / ``model.llm`` of the schema, plus the family's own
keys in their ``extra`` maps) and return typed data: :class:`Architecture` holds, per module, its
blocks (:class:`Attention` kind full / window / linear with heads and dims, :class:`Mlp` kind dense
/ MoE with widths, experts and top-k), parameter counts split by TP, its hand-off ends and its
input/head sizes, plus the family's :class:`Capabilities`. The planner's memory, FLOPs and time read
only this (``dhp.plan.params.architecture``); validation reads :meth:`FamilyArch.validate` and the
capabilities. A new family (an MoE LLM, a hybrid linear-attention LLM) declares data here, e.g.
``blocks`` with per-layer attention kinds and an ``Mlp(kind="moe", experts=..., top_k=...)``.
Nothing here imports torch: the planner stays pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dhp.config.plan_space import ModuleAxes as ModuleAxes  # declared by each family, read by the rule

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from dhp.config.issues import Issues


@dataclass(frozen=True)
class ParamCount:
    """Parameters of one module: those TP shards, those every TP rank replicates, and the routed
    experts of an MoE (``expert``: split over the EP ranks, whole on every TP rank; 0 for a dense model)."""

    tp_sharded: int
    replicated: int
    expert: int = 0

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated + self.expert

    def __add__(self, other: ParamCount) -> ParamCount:
        """Both parts' parameters together (e.g. a layer's attention and its MLP)."""
        return ParamCount(
            self.tp_sharded + other.tp_sharded, self.replicated + other.replicated, self.expert + other.expert
        )

    def per_tp_rank(self, tp: int) -> float:
        """Parameters on one TP rank without expert parallelism (every expert whole)."""
        return self.tp_sharded / tp + self.replicated + self.expert

    def per_rank(self, *, tp: int, ep: int) -> float:
        """Parameters on one rank of a TP x EP plan (before FSDP): experts divided by ``ep``."""
        return self.tp_sharded / tp + self.replicated + self.expert / ep


@dataclass(frozen=True)
class LayerShape:
    """Sizes that set one transformer layer's activations: hidden, MLP, KV width, heads."""

    hidden: int
    mlp: int
    kv_dim: int  # num_kv_heads * head_dim (== hidden without GQA)
    heads: int
    layers: int
    q_dim: int = 0  # num_heads * head_dim, the q/o projections' width; 0: == hidden
    #: column-parallel projections reading the block's input (q, k, v, gate, up unfused: 5; a fused
    #: qkv: 3; an ungated MLP: one fewer): under TP each one's input grad is all-reduced on its own
    tp_input_grads: int = 5
    #: the MLP's activations kept for backward: gated (SwiGLU: gate, up, act(gate), product: 4m) or
    #: ungated (fc1 out = the activation's input, activation out: 2m)
    gated_mlp: bool = True


#: the schema's ``model.vision`` / ``model.llm`` sizes every family has (each must be positive)
VISION_SIZES = (
    "depth",
    "hidden_size",
    "num_heads",
    "intermediate_size",
    "patch_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "in_channels",
)
LLM_SIZES = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size")

# --- the typed architecture the planner reads ------------------------------------------------------
ATTENTION_KINDS = ("full", "window", "linear")
MLP_KINDS = ("dense", "moe")


#: Gated DeltaNet's chunk length when a family declares none (flash-linear-attention's and
#: transformers' ``chunk_size=64``)
DELTA_RULE_CHUNK = 64


@dataclass(frozen=True)
class Attention:
    """One block's token mixer.

    ``full``: every token of a span attends to the span (``causal``: a sequence, each query sees
    S/2 keys on average, one kernel call per block; not causal: each image of a varlen batch, one call
    per image). ``window``: non-causal attention inside windows of ``window`` tokens (Ulysses SP cuts
    on window boundaries, so these blocks exchange nothing). ``linear``: a recurrent state instead of
    a KV cache (Gated DeltaNet, computed by the chunked gated delta rule): ``heads`` value heads (the
    recurrence runs once per value head), ``kv_heads`` query/key heads of ``head_dim`` = d_k (repeated
    to the value heads), ``value_dim`` = d_v per value head (0: ``state / head_dim``, else
    ``head_dim``), ``state`` = d_k x d_v elements per head, ``chunk`` tokens per chunk (0:
    :data:`DELTA_RULE_CHUNK`) and a short causal depthwise conv1d of ``conv_kernel`` taps over the
    q/k/v channels. Its mixing cost is linear in the sequence (:meth:`delta_rule_flops`); it has no
    score matrix and no span.
    """

    kind: str
    heads: int
    kv_heads: int
    head_dim: int
    window: int = 0  # tokens per window (``window``)
    state: int = 0  # recurrent state elements per head (``linear``)
    causal: bool = False
    value_dim: int = 0  # d_v per value head (``linear``; 0: state / head_dim, or head_dim)
    chunk: int = 0  # tokens per chunk of the chunked delta rule (``linear``; 0: DELTA_RULE_CHUNK)
    conv_kernel: int = 0  # taps of the short causal conv1d over q/k/v (``linear``; 0: none)
    #: a per-head RMSNorm on q and on k before the rotary embedding (Qwen3's ``q_norm``/``k_norm``):
    #: its fp32 input and normalized output are saved for backward
    qk_norm: bool = False

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    # ---- linear attention (Gated DeltaNet) ----------------------------------------------------
    @property
    def d_v(self) -> int:
        """Value width per head of a linear block."""
        if self.value_dim:
            return self.value_dim
        return self.state // self.head_dim if self.state else self.head_dim

    @property
    def chunk_len(self) -> int:
        return self.chunk or DELTA_RULE_CHUNK

    @property
    def key_width(self) -> int:
        """K = key heads x d_k: the width of q and of k (linear)."""
        return self.kv_heads * self.head_dim

    @property
    def value_width(self) -> int:
        """V = value heads x d_v: the width of v, z and the core output (linear)."""
        return self.heads * self.d_v

    @property
    def conv_channels(self) -> int:
        """Channels of the short conv1d: q, k and v (2K + V)."""
        return 2 * self.key_width + self.value_width

    def state_elems(self) -> int:
        """Recurrent state of one sequence: value heads x d_k x d_v (a KV cache's counterpart)."""
        return self.heads * self.head_dim * self.d_v

    def delta_rule_flops(self) -> float:
        """Forward FLOPs per token of the chunked gated delta rule over all heads (linear blocks).

        Per value head and chunk of C tokens (d_k, d_v the head's key / value widths), as the chunked
        algorithm computes it (transformers' ``torch_chunk_gated_delta_rule``; flash-linear-attention's
        kernel does the same products)::

            intra-chunk, C^2 terms:  k_beta k^T (C^2 d_k), q k^T (C^2 d_k), intra-scores x v_new
                                     (C^2 d_v), two unit-triangular solves of the UT transform
                                     (C^2/2 (d_k + d_v))
            state terms, C d_k d_v:  k_cumdecay S and q S (reads of the state), k^T v_new (update)

            MACs / chunk / head = C^2 (2.5 d_k + 1.5 d_v) + 3 C d_k d_v
            FLOPs / token       = 2 heads (C (2.5 d_k + 1.5 d_v) + 3 d_k d_v)

        Linear in the sequence length (S/C chunks of constant cost); the elementwise gating, decay and
        l2-norms are left out (no matmul).
        """
        if self.kind != "linear":
            return 0.0
        c, dk, dv = self.chunk_len, self.head_dim, self.d_v
        return 2.0 * self.heads * (c * (2.5 * dk + 1.5 * dv) + 3.0 * dk * dv)

    def proj_macs(self, hidden: int) -> float:
        """Multiply-accumulates per token of the mixer's weights: q/o and k/v projections; a linear
        block's in_proj (q, k, v: 2K + V; gate z: V; beta and decay a: 2 per value head), out_proj
        (V -> hidden) and its depthwise conv1d (``conv_kernel`` taps per q/k/v channel)."""
        if self.kind != "linear":
            return float(2 * hidden * self.q_dim + 2 * hidden * self.kv_dim)
        k, v = self.key_width, self.value_width
        return float(hidden * (2 * k + v) + hidden * v + 2 * hidden * self.heads + v * hidden) + float(
            self.conv_channels * self.conv_kernel
        )

    def span(self, *, seq_len: float, sample: float) -> float:
        """Keys one query attends to (the FLOPs' span): ``sample`` is one image's tokens. A linear
        block has no scores: 0 (its mixing is :meth:`delta_rule_flops`)."""
        if self.kind == "window":
            return float(min(self.window, sample))
        if self.kind == "linear":
            return 0.0
        return seq_len / 2.0 if self.causal else float(sample)


@dataclass(frozen=True)
class Mlp:
    """One block's MLP: ``dense`` (``intermediate`` wide) or ``moe`` (``experts`` experts of
    ``intermediate`` each, ``top_k`` active per token, a router of ``experts`` x hidden, plus a
    ``shared`` always-on expert width)."""

    kind: str
    intermediate: int
    gated: bool = True  # SwiGLU-style gate/up/down (3 matrices) or up/down (2)
    experts: int = 0
    top_k: int = 0
    shared: int = 0

    @property
    def active(self) -> int:
        """MLP width one token passes through (top-k experts + shared for an MoE)."""
        return self.intermediate * self.top_k + self.shared if self.kind == "moe" else self.intermediate

    @property
    def matrices(self) -> int:
        return 3 if self.gated else 2

    def saved_widths(self, *, selective: bool) -> int:
        """Multiples of the MLP width one token keeps for backward: gated, the gate and up outputs,
        the activation's output and the product (4; selective AC keeps the two matmul outputs: 2);
        ungated, the first matmul's output (the activation's input) and the activation's output
        (2; selective: 1)."""
        return (self.matrices - 1) * (1 if selective else 2)

    def expert_params(self, hidden: int) -> int:
        """Parameters of the routed experts (the tensors EP shards): experts x matrices x hidden x I."""
        return self.experts * self.matrices * hidden * self.intermediate if self.kind == "moe" else 0

    def inactive_params(self, hidden: int) -> int:
        """Expert parameters a token does not pass through: (experts - top_k) experts' matrices."""
        if self.kind != "moe":
            return 0
        return (self.experts - self.top_k) * self.matrices * hidden * self.intermediate

    def macs(self, hidden: int) -> float:
        """Multiply-accumulates per token: the active width's matrices, plus the router (hidden x
        experts) of an MoE."""
        router = hidden * self.experts if self.kind == "moe" else 0
        return float(self.matrices * hidden * self.active + router)

    def expert_macs(self, hidden: int) -> float:
        """The routed experts' share of :meth:`macs` (top_k x matrices x hidden x I)."""
        return float(self.matrices * hidden * self.intermediate * self.top_k) if self.kind == "moe" else 0.0


@dataclass(frozen=True)
class Block:
    """One transformer block: its token mixer and its MLP."""

    attention: Attention
    mlp: Mlp


@dataclass(frozen=True)
class ModuleArch:
    """What the planner knows about one module (an actor group's model): its blocks as data, its
    parameter counts, and its ends.

    ``inputs``/``outputs`` are the hand-off edges it consumes / produces (by edge name); a module with
    no inputs needs no backward when frozen. ``input_row`` > 0: the module reads fp32 rows of that many
    elements (patches) instead of token ids; ``merge`` input rows become one output row of
    ``out_width`` columns (the merger); ``head_macs`` are the matmul multiply-accumulates per input
    token outside the blocks (merger, lm_head); ``vocab`` > 0: the module computes the loss over a
    vocab-parallel head. ``sp_unit``: Ulysses SP cuts an image's tokens on multiples of this many.
    """

    hidden: int
    blocks: tuple[Block, ...]
    params: ParamCount
    block_params: ParamCount  # ONE block (an FSDP unit); the largest when blocks differ
    largest_param: int
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    handoff_width: int = 0  # columns of one output row summed over every edge out
    out_width: int = 0  # columns of the main output row (the merger's)
    input_row: int = 0
    merge: int = 1
    temporal_patch: int = 1  # video frames folded into one input row
    head_macs: float = 0.0
    vocab: int = 0
    sp_unit: int = 1
    #: mergers besides the main one, each reading one block's output (DeepStack levels): a norm over
    #: the merged row (``merge`` inputs), matmul, activation, matmul; each keeps its norm, first
    #: matmul and activation outputs for backward (3 merged rows per ``merge`` input rows)
    side_mergers: int = 0
    tp_input_grads: int = 5  # see LayerShape
    tensors_per_block: int = 12
    root_tensors: int = 3

    @property
    def layers(self) -> int:
        return len(self.blocks)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: ``params`` with each MoE block's experts counted at
        ``top_k`` of ``experts`` (== ``params.total`` for a dense module)."""
        idle = sum(
            (b.mlp.experts - b.mlp.top_k) * b.mlp.matrices * self.hidden * b.mlp.intermediate
            for b in self.blocks
            if b.mlp.kind == "moe"
        )
        return self.params.total - idle

    def count(self, *kinds: str) -> int:
        """Blocks whose attention is one of ``kinds``."""
        return sum(1 for b in self.blocks if b.attention.kind in kinds)

    @property
    def sp_exchange_blocks(self) -> int:
        """Blocks whose attention needs Ulysses' all-to-all (all but window blocks)."""
        return self.layers - self.count("window")

    def spans(self, *, seq_len: float, sample: float) -> list[tuple[int, float]]:
        """(blocks, span per query) groups, in block order of first appearance."""
        out: dict[float, int] = {}
        for b in self.blocks:
            s = b.attention.span(seq_len=seq_len, sample=sample)
            out[s] = out.get(s, 0) + 1
        return [(n, s) for s, n in out.items()]

    def block_macs(self) -> float:
        """Matmul multiply-accumulates per token of all blocks: the mixer's projections (q/o, k/v; a
        linear block's in/out projections and conv1d), the MLP's ACTIVE width (top-k experts + shared)
        and the router: FLOPs follow the active parameters only."""
        return sum(b.attention.proj_macs(self.hidden) + b.mlp.macs(self.hidden) for b in self.blocks)

    def expert_macs(self) -> float:
        """The routed experts' share of :meth:`block_macs` (what EP computes on the tokens it receives)."""
        return sum(b.mlp.expert_macs(self.hidden) for b in self.blocks)

    def delta_rule_flops(self) -> float:
        """Forward FLOPs per token of every linear block's chunked delta rule (linear in S)."""
        return sum(b.attention.delta_rule_flops() for b in self.blocks)

    # ---- mixture of experts -------------------------------------------------------------------
    @property
    def moe_blocks(self) -> int:
        return sum(1 for b in self.blocks if b.mlp.kind == "moe")

    @property
    def experts(self) -> int:
        """Experts per MoE block (the largest; 0 without MoE)."""
        return max((b.mlp.experts for b in self.blocks if b.mlp.kind == "moe"), default=0)

    def layer_shape(self) -> LayerShape:
        """The activation sizes of the widest block (every block, when they are alike)."""
        b = max(self.blocks, key=lambda x: (x.mlp.active, x.attention.q_dim, x.attention.kv_dim))
        q = b.attention.q_dim
        return LayerShape(
            hidden=self.hidden,
            mlp=b.mlp.active,
            kv_dim=b.attention.kv_dim,
            heads=b.attention.heads,
            layers=self.layers,
            q_dim=0 if q == self.hidden else q,
            tp_input_grads=self.tp_input_grads,
            gated_mlp=b.mlp.gated,
        )


@dataclass(frozen=True)
class Capabilities:
    """What a family's runtime code does exactly; anything not declared is refused by validation.

    ``packing``: several samples in one row (``data.packing``); ``video``: video inputs;
    ``tp_sharded``: per module, the parameter FQN globs tensor parallelism shards (the rest are
    replicated). The parallel axes each module supports, with the sizes each degree must divide, are
    the family's ``module_axes`` (:class:`ModuleAxes`), which the plan-validity rule reads.
    """

    packing: bool
    video: bool
    tp_sharded: Mapping[str, tuple[str, ...]]


@dataclass(frozen=True)
class Architecture:
    """A model as the generic layers see it: its modules (producers before consumers) and capabilities."""

    modules: Mapping[str, ModuleArch]
    capabilities: Capabilities


def palm_flops(arch: ModuleArch, samples: list[int], *, frozen: bool) -> float:
    """Model FLOPs of one module by the PaLM formula (appendix B), as MFU counts them.

    Per token, training = 6 N + 12 h x (sum over blocks of the span) + 3 x the linear blocks' delta
    rule, N = the matmul MACs per token of the ACTIVE parameters (blocks with the top-k experts and
    the router, head, and the patch embedding of a pixel-input module); a causal block's span counts
    as the full S, as PaLM does; a linear block's mixing (:meth:`Attention.delta_rule_flops`, forward)
    counts three times, like the matmuls. ``samples``: tokens of each image (a pixel-input module) or
    of each sequence. Forward only (a frozen module): a third.
    """
    n = arch.block_macs() + arch.head_macs + arch.input_row * arch.hidden
    linear = 3.0 * arch.delta_rule_flops()
    total = 0.0
    for p in samples:
        # seq_len=2p: a causal block's S/2 is the PaLM span p
        span = sum(b.attention.span(seq_len=2.0 * p, sample=p) for b in arch.blocks)
        total += p * (6.0 * n + 12.0 * arch.hidden * span + linear)
    return total * (1 / 3 if frozen else 1.0)


def model_flops(
    arch: Architecture, *, images: list[int], seq_lens: list[int], frozen: Mapping[str, bool]
) -> float:
    """PaLM FLOPs of a step over the modules in ``frozen`` (the run's): images feed the pixel-input
    modules, sequence lengths the others."""
    return sum(
        palm_flops(m, images if m.input_row else seq_lens, frozen=frozen[name])
        for name, m in arch.modules.items()
        if name in frozen
    )


def uniform_blocks(n: int, attention: Attention, mlp: Mlp) -> tuple[Block, ...]:
    """``n`` identical blocks."""
    return tuple(Block(attention, mlp) for _ in range(n))


# --- parallel axes, by config key (ModuleAxes is the plan-validity rule's, dhp.config.plan_space) ----
def encoder_axes(*, heads: int, merged_width: int) -> ModuleAxes:
    """A ViT encoder with a patch merger: TP over its heads and the merger's width (``hidden *
    spatial_merge_size**2``), Ulysses SP over its heads; no sequence parallelism inside TP."""
    h = {"model.vision.num_heads": heads}
    wide = {"model.vision.hidden_size*spatial_merge_size^2": merged_width}
    return ModuleAxes(tp=True, sp=True, tp_sequence_parallel=False, tp_divides=h | wide, sp_divides=h)


def decoder_axes(
    *,
    heads: int,
    kv_heads: int,
    vocab: int,
    mlp: int | None,
    sequence_parallel: bool,
    head_groups: Mapping[str, int] | None = None,
    context_parallel: bool = False,
    cp_divides: Mapping[str, int] | None = None,
    pipeline: bool = False,
    layers: int = 0,
    tied: bool = False,
) -> ModuleAxes:
    """A decoder LLM: TP over the attention heads, KV heads, other ``head_groups`` (config key ->
    count), the vocabulary and the MLP width (``mlp``; None: no TP-sharded MLP); Megatron sequence
    parallelism inside TP where ``sequence_parallel``; context parallelism where ``context_parallel``
    (the family's forward computes positions on the whole sequence, then cuts: ``dhp.parallel.cp``);
    pipeline stages cut over its ``layers`` decoder layers where ``pipeline``, refused with ``tied``
    word embeddings; no Ulysses SP."""
    divides = {"model.llm.num_heads": heads, "model.llm.num_kv_heads": kv_heads, **(head_groups or {})}
    divides["model.llm.vocab_size"] = vocab
    if mlp is not None:
        divides["model.llm.intermediate_size"] = mlp
    return ModuleAxes(
        tp=True,
        sp=False,
        tp_sequence_parallel=sequence_parallel,
        tp_divides=divides,
        cp=context_parallel,
        cp_divides=dict(cp_divides or {}),
        cp_sequence_parallel=not cp_divides,  # linear-attention layers gather the sequence themselves
        pp=pipeline,
        pp_layers=layers if pipeline else 0,
        pp_refused=_pp_refused(tied=tied),
    )


def _pp_refused(*, tied: bool) -> dict[str, tuple[Any, str]]:
    """The decoder settings pipeline stages cannot run with (``ModuleAxes.pp_refused``)."""
    out: dict[str, tuple[Any, str]] = {}
    if tied:
        out["model.llm.tie_word_embeddings"] = (
            True,
            "the embedding (first stage) and the lm_head (last stage) would share one weight across stages",
        )
    return out


class FamilyArch(Protocol):
    """Architecture numbers -> validation, the typed architecture and the parallel axes of one family
    (pure). Everything the planner counts (parameters, one block's, the largest tensor, activation
    sizes) is read from :meth:`architecture`'s :class:`ModuleArch`, never asked twice.

    ``module_names``: the family's modules, producers first (the keys ``modules.<name>`` of a run
    may use; validation reads it without building the architecture)."""

    module_names: tuple[str, ...]

    def validate(self, model: DictConfig, issues: Issues) -> None:
        """Add an issue for every architecture number this family cannot build (incl. ``extra`` keys)."""
        ...

    def architecture(self, model: DictConfig) -> Architecture:
        """The typed architecture: every module's blocks, ends and counts, and the capabilities."""
        ...

    @property
    def capabilities(self) -> Capabilities:
        """What the family's runtime does exactly (no architecture numbers needed)."""
        ...

    def module_axes(self, name: str, model: DictConfig) -> ModuleAxes:
        """The parallel axes module ``name`` supports and what each degree must divide: the one
        declaration validation, the search and the runtime plan (``dhp.models.axes``) all read."""
        ...
