"""Per-rank memory terms of one module, in bytes. ``dhp/plan/phases.py`` lays them on a timeline.

Bytes per parameter are what the runtime allocates (``dhp/parallel/precision.py``: the worker
stores the parameters in the policy's dtype whatever ``model.dtype`` the weights come in; torch's
AdamW keeps ``exp_avg``/``exp_avg_sq`` in the parameter's dtype; gradients accumulate in it, FSDP2
reduce-scatters into it):

    mixed_precision    params  grads  optimizer (AdamW: 2 states)  compute a  FSDP reduce  cast
    fp32                 4       4      8   -> 16 B/param             4          4          0
    bf16_master_fp32     4       4      8   -> 16 B/param             2          4          2
    bf16                 2       2      4   ->  8 B/param             2          2          0

Compute (activation) bytes ``a``: the policy's compute dtype, in every plan (FSDP2's policy and, at
fsdp=1, the unit cast give the same bf16 compute): saved activations, transients, the hand-off rows
(both ways), FSDP's all-gathered blocks, the TP/SP/EP exchanges.

Compute copies (``cast`` > 0: master weights): a unit casts its parameters to bf16 as it runs.
Under FSDP that cast is the all-gather (``fsdp_gather``); the parameters FSDP does not gather (all of
them at fsdp=1, the routed experts under FSDP x EP) are cast by the unit itself
(:func:`compute_copy_elems`): the root's copies (embeddings, lm_head, patch embedding, merger) and
the blocks' copies are saved for backward (``compute_weights``, per micro-batch), except the
checkpointed blocks' (full / every_n / selective AC: dropped at the block's end and cast again in its
recompute: one block's copy, ``compute_block``, in its forward and its backward).

Sharding of the model states (P = the module's parameters, ``params.py``: ``tp_sharded``,
``replicated`` and the routed experts ``expert``, :class:`~dhp.models.arch.ParamCount`):

    P_rank = (P_tp_sharded / tp + P_replicated) / fsdp
    X_rank = P_expert / expert_param_shards    (ep x etp, times edp under expert FSDP)
    params = (P_rank + X_rank) * b_param;  grads = (P_rank + X_rank) * b_grad (0 when frozen)
    optimizer = P_rank * b_opt / (dp * sp) with zero=1 (``ZERO1_AXES``), else P_rank * b_opt;
                + P_expert * b_opt / (ep x etp x edp) with zero=1 or expert FSDP,
                  else P_expert * b_opt / (ep x etp)     (``ParallelLayout.expert_state_split``)

Expert parallelism (``dhp/parallel/ep.py``): rank r of an all-to-all group of ep x etp ranks
(``ParallelLayout.expert_group``) holds experts [r E/(ep etp), (r+1) E/(ep etp)) of every MoE
block. Without expert FSDP the expert parameters (and their grads) are REPLICATED over the
edp = dp*fsdp*cp*sp/ep ranks that hold the same experts (FSDP shards only the other parameters,
whose finalize step skips the experts), so fsdp does not divide X_rank; ZeRO-1 partitions the
experts' AdamW states over those edp ranks (``Zero1AdamW``'s expert partition). With expert FSDP
(``expert_fsdp``) FSDP2 shards the experts' parameters, grads and states over their edp ranks
too: 1/(ep x etp x edp) of each per rank; each MoE layer's local experts (1/(ep x etp) of its
experts, unsharded) are all-gathered in the compute dtype while the layer runs forward and again
in its backward (``expert_fsdp_gather``: two layers in flight with prefetch, as the dense blocks),
and backward holds one layer's unsharded expert gradient before its reduce-scatter over edp.

Expert TP (``etp = tp``): each TP rank of a unit routes 1/tp of the unit's tokens, so every
per-token expert term of the blocks (the received rows, the experts' activations, the routing
permutations; ``dhp/plan/blocks.py``) is 1/etp of what it is at etp=1, and the MoE output is
all-gathered over TP (``etp_output_gather``: T x h in the compute dtype, in forward; its gradient
in backward). The load-balancing loss's router probabilities are counted for all of the unit's
tokens whatever etp (an upper bound).

Saved activations of one micro-batch (per token and layer, pre-norm SwiGLU block; h hidden, m MLP,
kv the K/V width; calibrated against autograd's saved tensors in
tests/unit/plan/test_activation_calibration.py)::

    per_layer = 4h/s + (4h + 3kv)/tp + 4m/tp      s = tp under LLM sequence_parallel, else 1
    selective = 2h/s + (2h + 2kv)/tp + 2m/tp      matmul outputs kept (q, k, v, attention out,
                                                  gate, up); norms, rotary, SiLU recomputed
    an ungated MLP (fc1, activation, fc2: a ViT's) keeps 2m/tp (selective m/tp) instead of 4m/tp
    off:        L * per_layer
    full:       L * h/s  (block inputs)           + one block recomputed in backward (working set)
    every_n:K:  ceil(L/K) * h/s + (L - ceil(L/K)) * per_layer
    selective:  L * selective
    frozen encoder (no backward): nothing saved; one block's working set in forward

Blocks that differ (a hybrid of linear- and full-attention blocks, MoE MLPs) sum their own
per_layer / selective (``dhp/plan/blocks.py``: a Gated DeltaNet mixer, the experts' activations,
the received and combined rows and the routing indices; selective keeps only the matmul outputs and
recomputes the exchanges); every_n drops ceil(L/K)/L of every block's. The load-balancing loss of a
module with MoE blocks saves its fp32 router probabilities outside the blocks (``router_aux``: every
AC mode keeps them). The one-block working
set is the largest block's, plus a linear block's chunk states (transient in its forward and
backward, whatever the AC mode).

MoE dispatch/combine buffers: at the planner's token count with a BALANCED router (each rank
receives as many rows as it sends: r = 1 in ``blocks.py``). The verdict (fits / OOM) uses this one,
because training keeps the router balanced with its load-balancing loss; the worst case (a fully
unbalanced router: every token of the EP group to one rank's experts, r = ep) is computed beside it
(``moe_worst_case``) and printed as what the same plan would need then.

Transients (the working set of the phase that allocates them, never summed across phases):
one recomputed block (``per_layer``) under AC, the gradient of the hidden state (2h/s per token),
eager attention scores, Ulysses all-to-all send/receive buffers (q, k, v: 2 * 3h/tp per local
token, full-attention blocks only), FSDP's all-gathered blocks (2 in flight with prefetch), the
root unit it keeps gathered from forward to backward, one block's unsharded gradient before its
reduce-scatter, the loss's logits chunk, the flat DP/SP gradient all-reduce buffer, the fp64
squares of the grad norm, and AdamW's temporaries (``train.optimizer.impl``: ``phases.adamw_temp_elems``).

The loss (``dhp/ops/cross_entropy.py``: vocab-parallel, fp32, chunked, recomputed in backward):
with ``c`` tokens per chunk (``loss_chunk_tokens``; 0 = ``default_loss_chunk``, never above the
micro-batch's tokens), forward holds ``c * V/tp * (a + 4)`` (logits, fp32 log-softmax) and backward
``c * V/tp * (a + 8)`` (recomputed logits, log-softmax, fp32 grad) plus the lm_head's fp32 weight
gradient accumulator ``V/tp * h * 4``. It saves for backward only the label tokens' hidden rows
(counted as every token: ``T * h * a``), their targets (int64) and log-sum-exp (fp32): no logits,
whatever the chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig

from dhp.config.ac import AcMode, parse_ac_mode
from dhp.layout import ParallelLayout
from dhp.ops.linear_attn import TORCH_FALLBACK, planned_kernel
from dhp.plan.blocks import block_saved_elems, delta_rule_states_bytes, router_aux_bytes
from dhp.plan.graph import module_graph
from dhp.plan.params import LayerShape, ModuleArch, ParamCount, architecture
from dhp.plan.tp_blocks import relayout_elems
from dhp.plan.trainable import trainable_fraction

FSDP_LAYERS_IN_FLIGHT = 2  # the block being computed and the prefetched next one
# Loss chunk chosen when ``loss_chunk_tokens`` is 0: fp32 logits of one chunk <= this many bytes.
LOSS_CHUNK_TARGET_BYTES = 256 << 20
LOSS_CHUNK_MIN, LOSS_CHUNK_MAX = 256, 8192


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state, and per activation element."""

    param: int
    grad: int
    optimizer: int
    act: int
    reduce: int  # bytes per element of FSDP's reduce-scatter of gradients
    cast: int = 0  # bytes per element of a parameter's compute copy (master weights), else 0

    @property
    def per_param(self) -> int:
        return self.param + self.grad + self.optimizer


#: ``mixed_precision`` -> bytes of (parameter, compute, FSDP reduce) elements: the dtypes of
#: ``dhp.parallel.precision.PRECISIONS`` (torch-free here)
PRECISION_BYTES: dict[str, tuple[int, int, int]] = {
    "fp32": (4, 4, 4),
    "bf16_master_fp32": (4, 2, 4),
    "bf16": (2, 2, 2),
}


def precision(mixed_precision: str) -> Precision:
    """What the runtime allocates under ``mixed_precision`` (see the module docstring)."""
    p, a, r = PRECISION_BYTES[mixed_precision]
    return Precision(param=p, grad=p, optimizer=2 * p, act=a, reduce=r, cast=a if a != p else 0)


@dataclass(frozen=True)
class ModuleShape:
    """What the estimate needs about one module, independent of the rank."""

    name: str
    params: ParamCount
    layer_params: ParamCount
    largest_param: int
    layer: LayerShape
    layout: ParallelLayout  # the module group's degrees (dhp.layout)
    seq_len: int
    micro_batch: int
    ac: AcMode
    freeze: bool
    backward: bool  # False only for a frozen module that feeds nothing trainable upstream
    precision: Precision
    attn_implementation: str
    loss_chunk_tokens: int = 0  # resolved (never 0 for the LLM)
    image_patches: int = 0  # a pixel-input module: the span of a full-attention block (one image)
    vocab: int = 0  # > 0: the module computes the loss (``arch.vocab``)
    out_hidden: int = 0  # a producer: the merger's output width (``arch.out_width``)
    handoff_width: int = 0  # a producer: columns of one hand-off row over all edges
    arch: ModuleArch | None = None  # the family's typed architecture of this module
    trainable: float = 1.0  # share of the params with grads + optimizer states (dhp.plan.trainable)
    #: MoE rows received per own assignment: 1 (balanced router, the verdict's) or ep (worst case)
    moe_received: float = 1.0
    #: linear blocks' delta rule runs as transformers' torch fallback (``dhp.ops.linear_attn``: the
    #: plan's device is not one the kernel packages run on), which saves more (``dhp/plan/blocks.py``)
    delta_rule_fallback: bool = False
    #: a step's phases in the driver's order (``dhp.plan.graph.ModuleGraph.phases``, the model's graph)
    phases: tuple[str, ...] = ()

    @property
    def pixels(self) -> bool:
        """The module reads patch rows (an encoder: ``seq_len`` counts the micro-batch's patches)."""
        return self.arch is not None and self.arch.input_row > 0

    @property
    def tokens(self) -> float:
        """Tokens one rank's layers see per micro-batch (before SP-in-TP cuts norms); an encoder:
        the fullest SP rank's (``sp_rank_tokens``); under context parallelism a CP rank's share of
        each row padded to ``token_multiple`` (``ParallelLayout.cp_rank_tokens``: what
        ``dhp.parallel.cp`` runs per rank)."""
        if self.pixels:
            return sp_rank_tokens(self.arch, self.seq_len, self.layout.sp, self.image_patches)
        return self.micro_batch * self.layout.cp_rank_tokens(self.seq_len)

    @property
    def row_len(self) -> int:
        """Tokens of one whole row as the runtime runs it (padded to ``token_multiple`` under CP): what
        a CP rank's full attention gathers keys of and its linear blocks gather the sequence of."""
        return self.layout.padded_tokens(self.seq_len) if not self.pixels else self.seq_len

    @property
    def seq_split(self) -> int:
        """s: how many ways the tensors between TP regions are cut by sequence."""
        return self.layout.seq_split


def encoder_replica_patches(seq_len: int, *, producer: ParallelLayout, consumer: ParallelLayout) -> int:
    """Patches one encoder replica encodes per driver micro-batch, at most. ``modules.vision.seq_len``
    bounds the patches of ONE LLM replica's micro-batch (what the data loader checks, whatever the
    layouts); with fewer encoder replicas than LLM replicas each serves ``L / V`` of them in one
    forward (``dhp.plan.placement.routing``: their images concatenated), so it encodes up to
    ``L / V x seq_len``; with more, a share of one micro-batch's images (whole images: up to
    ``seq_len``). Memory and time both count this many."""
    v, n = producer.num_replicas, consumer.num_replicas
    return seq_len * (n // v) if v <= n else seq_len


def sp_rank_tokens(arch: ModuleArch | None, patches: float, sp: int, image: int) -> float:
    """Patches the fullest of ``sp`` Ulysses ranks encodes out of ``patches``: the runtime cuts an
    image on multiples of the family's ``sp_unit`` (a window for a windowed encoder, a merge unit
    otherwise), so a rank holds whole units: ceil(units / sp) of them (an image of ``image`` patches
    has ceil(image / unit) units of equal share). With fewer units than ranks some ranks idle and
    the others hold a whole unit. No patches (a text-only micro-batch): 0, whatever ``image``."""
    if sp <= 1 or arch is None or patches <= 0:
        return float(max(patches, 0))
    image = image or int(patches)
    window = arch.sp_unit
    per_image = max(math.ceil(image / window), 1)
    size = image / per_image  # patches of one window
    windows = max(math.ceil(patches / size), 1)
    return min(float(patches), math.ceil(windows / sp) * size)


def default_loss_chunk(vocab: int, tp: int, tokens: int) -> int:
    """The loss chunk for ``loss_chunk_tokens=0``: the largest power of two whose fp32 logits on one
    vocab shard stay under LOSS_CHUNK_TARGET_BYTES, clamped to [LOSS_CHUNK_MIN, LOSS_CHUNK_MAX]."""
    fit = LOSS_CHUNK_TARGET_BYTES / max(vocab / tp * 4, 1)
    chunk = 1 << max(int(math.log2(max(fit, 1))), 0)
    return min(max(tokens, 1), max(LOSS_CHUNK_MIN, min(LOSS_CHUNK_MAX, chunk)))


def _without_experts(p: ParamCount) -> ParamCount:
    return ParamCount(tp_sharded=p.tp_sharded, replicated=p.replicated)


def non_expert_params(shape: ModuleShape) -> tuple[ParamCount, ParamCount]:
    """(the module's, its largest block's) parameters without the routed experts: what TP, FSDP
    and ZeRO-1 shard (and FSDP all-gathers)."""
    return _without_experts(shape.params), _without_experts(shape.layer_params)


def rank_params(shape: ModuleShape) -> tuple[float, float]:
    """(the non-expert parameters, the routed experts' parameters) one rank holds: the first TP- and
    FSDP-sharded, the second ``1/expert_param_shards`` of the experts (1/(ep x etp), replicated over
    edp; also 1/edp of that under expert FSDP; module docstring)."""
    lay = shape.layout
    return shape.params.per_tp_rank(lay.tp) / lay.fsdp - shape.params.expert / lay.fsdp, (
        shape.params.expert / lay.expert_param_shards
    )


def expert_layer_gather_elems(shape: ModuleShape) -> float:
    """Elements of one MoE layer's local experts as expert FSDP all-gathers them over edp (the
    largest block's routed experts / (ep x etp), unsharded); 0 without expert FSDP."""
    lay = shape.layout
    if not lay.expert_fsdp or not shape.params.expert:
        return 0.0
    return shape.layer_params.expert / lay.expert_group


def largest_local_param(shape: ModuleShape) -> float:
    """Elements of the largest parameter tensor on one rank: the family's largest / (tp * fsdp); when
    that is a routed-experts tensor (at least a third of one block's experts: a 3-D gate/up/down),
    1/expert_param_shards of it, or the vocabulary table / (tp * fsdp) if that is larger."""
    lay, big = shape.layout, shape.largest_param
    whole = big / (lay.tp * lay.fsdp)
    if not shape.params.expert or 3 * big < shape.layer_params.expert:
        return whole
    vocab = shape.arch.vocab * shape.arch.hidden if shape.arch is not None else 0
    return max(big / lay.expert_param_shards, vocab / (lay.tp * lay.fsdp))


def compute_copy_elems(shape: ModuleShape) -> tuple[float, float, float]:
    """(one block's, all blocks', the root's) parameter elements one rank casts to the compute dtype
    itself (module docstring: all at fsdp=1, only the routed experts under FSDP, which gathers the
    rest; under expert FSDP the experts' gather is their cast, so none of theirs); zeros without
    master weights. The block is the largest (``block_params``); the root is
    what the blocks leave of the module's parameters."""
    if not shape.precision.cast:
        return 0.0, 0.0, 0.0
    lay, layers = shape.layout, shape.layer.layers
    dense, dense_block = non_expert_params(shape)
    own = 0 if lay.expert_fsdp else 1  # expert FSDP gathers the experts in the compute dtype
    block = own * shape.layer_params.expert / lay.expert_group
    total = own * shape.params.expert / lay.expert_group
    if lay.fsdp == 1:
        block += dense_block.per_tp_rank(lay.tp)
        total += dense.per_tp_rank(lay.tp)
    blocks = min(layers * block, total)
    return block, blocks, total - blocks


def compute_copy_bytes(shape: ModuleShape) -> tuple[int, int, int]:
    """(saved for backward per micro-batch, forward transient, backward transient) bytes of the
    compute copies (:func:`compute_copy_elems`): the root's and the kept blocks' copies are saved; a
    checkpointed block's copy lives while it runs and while it is recomputed; without a backward
    (frozen, nothing upstream trains) nothing is saved and the root's copy and one block's live in
    forward."""
    block, blocks, root = compute_copy_elems(shape)
    if not block and not root:
        return 0, 0, 0
    cast, layers = shape.precision.cast, shape.layer.layers
    if not shape.backward:
        return 0, int((root + block) * cast), 0
    recomputed = layers if shape.ac.kind == "selective" else checkpointed_blocks(shape.ac, layers)
    one = int(block * cast) if recomputed else 0
    return int((root + blocks * (layers - recomputed) / layers) * cast), one, one


def model_states(shape: ModuleShape) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes resident on one rank; formulas in the module docstring."""
    lay, pr = shape.layout, shape.precision
    dense, experts = rank_params(shape)
    params = (dense + experts) * pr.param
    if shape.freeze:
        return int(params), 0, 0
    t = shape.trainable  # freeze_patterns / LoRA: only the trainable set has grads + states
    grads = (dense + experts) * t * pr.grad
    return (
        int(params),
        int(grads),
        int(
            dense * t * pr.optimizer / lay.optimizer_shards
            + experts * t * pr.optimizer / lay.expert_state_split
        ),
    )


def per_layer_elems(layer: LayerShape, tp: int, s: int = 1) -> float:
    h, m, kv = layer.hidden, layer.mlp, layer.kv_dim
    return 4 * h / s + (4 * h + 3 * kv) / tp + (4 if layer.gated_mlp else 2) * m / tp


def selective_elems(layer: LayerShape, tp: int, s: int = 1) -> float:
    h, m, kv = layer.hidden, layer.mlp, layer.kv_dim
    return 2 * h / s + (2 * h + 2 * kv) / tp + (2 if layer.gated_mlp else 1) * m / tp


def checkpointed_blocks(ac: AcMode, layers: int) -> int:
    """Blocks whose activations are dropped after forward and recomputed in backward."""
    if ac.kind == "full":
        return layers
    if ac.kind == "every_n":
        return -(-layers // ac.every_n)
    return 0


def recomputed_exchanges(ac: AcMode, layers: int) -> int:
    """Blocks whose all-to-alls (Ulysses' q/k/v/out, EP's dispatch and combine, the Gated DeltaNet
    TP weight re-layout) run again in backward: the checkpointed ones under full and every_n, EVERY
    block under selective, whose policy keeps the outputs of matmuls, attention and the SP-in-TP
    collectives but never an all-to-all's (``dhp.parallel.ac.SELECTIVE_SAVE``)."""
    return layers if ac.kind == "selective" else checkpointed_blocks(ac, layers)


def _uniform_dense(shape: ModuleShape) -> bool:
    """Every block is the calibrated full/window attention (no per-head q/k norms) + dense MLP of
    ``shape.layer``."""
    arch = shape.arch
    if arch is None:
        return True
    return all(
        b.attention.kind != "linear" and not b.attention.qk_norm and b.mlp.kind == "dense"
        for b in arch.blocks
    )


def _blocks_elems(shape: ModuleShape, *, selective: bool) -> list[float]:
    """Saved elements per token of every block (``dhp/plan/blocks.py``), or the calibrated uniform
    ``per_layer`` / ``selective`` of ``shape.layer`` for a model of dense full/window blocks."""
    layer, tp, s = shape.layer, shape.layout.tp, shape.seq_split
    if _uniform_dense(shape):
        one = selective_elems(layer, tp, s) if selective else per_layer_elems(layer, tp, s)
        return [one] * layer.layers
    gathered = 0.0 if selective else cp_gathered_input_elems(shape)
    return [
        block_saved_elems(
            b,
            hidden=shape.arch.hidden,
            tp=tp,
            s=s,
            selective=selective,
            received=shape.moe_received,
            fallback=shape.delta_rule_fallback,
            etp=shape.layout.etp,
            act=shape.precision.act,
        )
        + (gathered if b.attention.kind == "linear" else 0.0)
        for b in shape.arch.blocks
    ]


def cp_gathered_input_elems(shape: ModuleShape) -> float:
    """Extra saved elements per local token of a linear block under context parallelism
    (``dhp.parallel.linear_attn_cp``): its projections save the all-gathered whole sequence,
    ``cp x`` the rank's normed input, in place of the rank's own (``(cp - 1) h``); 0 without CP. The
    mixer's own activations at ``S`` tokens for ``1/cp`` of the heads equal ``S/cp`` tokens of all
    heads, which the per-token table already counts. Selective AC saves no gathered input (the gather
    is no matmul output: it runs again in the recompute)."""
    cp = shape.layout.cp
    return (cp - 1) * shape.arch.hidden if cp > 1 and shape.arch is not None else 0.0


def saved_layers_bytes(shape: ModuleShape) -> int:
    """Activations the blocks save for backward on one rank, one micro-batch."""
    if not shape.backward:
        return 0
    layer, s, a = shape.layer, shape.seq_split, shape.precision.act
    if shape.ac.kind == "selective":
        return int(shape.tokens * sum(_blocks_elems(shape, selective=True)) * a)
    ck = checkpointed_blocks(shape.ac, layer.layers)
    kept = sum(_blocks_elems(shape, selective=False)) * (layer.layers - ck) / layer.layers
    return int(shape.tokens * (ck * layer.hidden / s + kept) * a)


def block_work_bytes(shape: ModuleShape) -> int:
    """One block's working set: allocated while it runs forward without saving (AC, frozen), or
    while it is recomputed in backward (the largest block's)."""
    return int(shape.tokens * max(_blocks_elems(shape, selective=False)) * shape.precision.act)


def delta_rule_work_bytes(shape: ModuleShape) -> int:
    """The largest linear block's chunk states on one rank (``dhp/plan/blocks.py``; 0 without one):
    transient in that block's forward and in its backward, which recomputes them. Under CP the block
    runs the whole (gathered) row with ``1/cp`` of each TP rank's heads."""
    if shape.arch is None:
        return 0
    return max(
        (
            delta_rule_states_bytes(
                b.attention,
                seqs=shape.micro_batch,
                seq_len=shape.row_len,  # under CP: the gathered whole row, 1/cp of the heads
                tp=shape.layout.tp * shape.layout.cp,
                act=shape.precision.act,
            )
            for b in shape.arch.blocks
        ),
        default=0,
    )


def cp_full_blocks(shape: ModuleShape) -> int:
    """Blocks whose attention all-gathers keys and values over the context group (the score-based
    ones: full, causal or not; linear blocks gather their input instead); 0 without CP."""
    if shape.layout.cp <= 1 or shape.arch is None or shape.pixels:
        return 0
    return shape.arch.layers - shape.arch.count("linear")


def cp_kv_gather_bytes(shape: ModuleShape) -> int:
    """One full-attention block's all-gathered keys and values on one rank (``dhp.parallel.cp``):
    ``2 x S x kv_heads/tp x head_dim`` per row of the padded length ``S``, transient while the block's
    attention runs forward and again while the checkpointed attention is recomputed in backward; 0
    without CP or full-attention blocks."""
    if not cp_full_blocks(shape):
        return 0
    return int(
        shape.micro_batch * shape.row_len * 2 * shape.layer.kv_dim / shape.layout.tp * shape.precision.act
    )


def cp_mask_elems(shape: ModuleShape) -> float:
    """Entries of the context mask of one rank (``ContextShard.text_mask``): its ``S/cp`` queries of
    every row over the ``S`` gathered keys. Built once per micro-batch as booleans (kept for the
    recomputed attention: saved for backward); sdpa turns it into an additive bias of the compute
    dtype while a block's attention runs (transient). 0 without CP or full-attention blocks."""
    if not cp_full_blocks(shape):
        return 0.0
    return shape.micro_batch * shape.layout.cp_rank_tokens(shape.seq_len) * shape.row_len


def cp_sequence_gather_bytes(shape: ModuleShape) -> int:
    """A linear block's whole-row tensors under CP beyond what it saves (``dhp.parallel.linear_attn_cp``):
    forward its whole-row output partial sum and the all-reduced copy (``2 S h``), backward the
    gathered gradient and its all-reduced copy of the input (``2 S h``); 0 without CP or linear blocks."""
    if shape.layout.cp <= 1 or shape.arch is None or not shape.arch.count("linear"):
        return 0
    return int(2 * shape.micro_batch * shape.row_len * shape.arch.hidden * shape.precision.act)


def cp_work_bytes(shape: ModuleShape) -> tuple[int, int]:
    """(forward, backward) transient of the CP exchanges of the block that runs, the largest of a
    full-attention block's (gathered K/V + the mask's bias; backward: the re-gathered K/V, their
    gradients and the bias) and a linear block's (:func:`cp_sequence_gather_bytes`)."""
    kv = cp_kv_gather_bytes(shape)
    bias = int(cp_mask_elems(shape) * shape.precision.act)
    full_f, full_b = (kv + bias, 2 * kv + bias) if kv else (0, 0)
    lin = cp_sequence_gather_bytes(shape)
    return max(full_f, lin), max(full_b, lin) if shape.backward else 0


def eager_scores_bytes(shape: ModuleShape, *, seqs: float, seq: float, layers: int) -> int:
    """Scores + probabilities of eager attention: 2 * heads/(tp*sp) * S^2 per sequence and layer."""
    if shape.attn_implementation != "eager":
        return 0
    heads = shape.layer.heads / (shape.layout.tp * shape.layout.sp)
    return int(2 * heads * seq * seq * seqs * layers * shape.precision.act)


def _eager_saved_and_work(shape: ModuleShape) -> tuple[int, int]:
    """(saved, one-block transient) bytes of eager attention scores, per block by its attention:
    causal -> the micro-batch's sequences of ``seq_len``; non-causal full -> one image per span;
    window -> ``seq_len / window`` windows; linear -> no score matrix."""
    if shape.attn_implementation != "eager" or shape.arch is None:
        return 0, 0
    span = shape.image_patches or shape.seq_len
    per_block: list[int] = []
    for block in shape.arch.blocks:
        att = block.attention
        if att.kind == "linear":
            per_block.append(0)
        elif att.kind == "window":
            seqs = max(shape.seq_len // att.window, 1)
            per_block.append(eager_scores_bytes(shape, seqs=seqs, seq=att.window, layers=1))
        elif att.causal:
            per_block.append(eager_scores_bytes(shape, seqs=shape.micro_batch, seq=shape.seq_len, layers=1))
        else:
            per_block.append(eager_scores_bytes(shape, seqs=shape.seq_len / span, seq=span, layers=1))
    kept = 1 - checkpointed_blocks(shape.ac, shape.layer.layers) / shape.layer.layers
    saved = int(sum(per_block) * kept) if shape.backward and shape.ac.kind != "selective" else 0
    return saved, max(per_block, default=0)


def eager_block_bytes(shape: ModuleShape) -> int:
    """One block's eager attention scores (a transient of the block that runs)."""
    return _eager_saved_and_work(shape)[1]


def activations_of(shape: ModuleShape) -> dict[str, int]:
    """Saved-for-backward bytes of one rank and micro-batch of ``shape``'s module, by component:
    the blocks, eager scores, and the module's ends as its architecture declares them (patch rows
    in fp32 and the merger for a pixel-input producer; the loss inputs and final norm for a module
    with a vocabulary head; the load-balancing loss's router probabilities of a module with MoE
    blocks, which no AC mode drops)."""
    arch, a, tokens = shape.arch, shape.precision.act, shape.tokens
    eager, _ = _eager_saved_and_work(shape)
    out = {"layers": saved_layers_bytes(shape), "attention_scores": eager}
    copies = compute_copy_bytes(shape)[0]  # master weights' bf16 copies (0 without)
    if copies:
        out["compute_weights"] = copies
    keep = 1 if shape.backward else 0
    h = arch.hidden
    if arch.input_row:
        out["inputs"] = int(tokens * arch.input_row * 4)
    if arch.out_width:
        out["merger"] = keep * int(tokens * (2 * h + 3 * h) * a + tokens / arch.merge * arch.out_width * a)
    if arch.side_mergers:  # norm, matmul and activation outputs: 3 merged rows of h * merge each
        out["side_mergers"] = keep * int(arch.side_mergers * tokens * 3 * h * a)
    if arch.vocab:
        out["loss_inputs"] = int(tokens * (h * a + 8 + 4)) if shape.backward else 0
        out["final_norm"] = int(tokens * 2 * h / shape.seq_split * a)
    if cp_full_blocks(shape):  # the boolean context mask, kept for the recomputed attention
        out["cp_mask"] = keep * int(cp_mask_elems(shape))
    if arch.moe_blocks:
        out["router_aux"] = keep * int(tokens * router_aux_bytes(arch.blocks))
    copies = relayout_copies_bytes(shape)
    if copies:  # per micro-batch, whatever its tokens: the linear blocks' head-layout weights
        kept = (
            0.0
            if shape.ac.kind == "selective"
            else 1 - checkpointed_blocks(shape.ac, arch.layers) / arch.layers
        )
        out["tp_weight_copies"] = keep * int(copies * kept)
    return out


def relayout_copies_bytes(shape: ModuleShape, *, largest: bool = False) -> int:
    """Bytes of the head-layout weight copies the linear blocks receive by all-to-all under TP
    (``dhp/plan/tp_blocks.py``), summed over the blocks (what AC off saves) or the largest block's
    (``largest``: one exchange's copy); 0 without linear blocks or TP."""
    if shape.arch is None:
        return 0
    tp, h, a = shape.layout.tp, shape.arch.hidden, shape.precision.act
    per = [sum(relayout_elems(b.attention, hidden=h, tp=tp)) * a for b in shape.arch.blocks]
    return int(max(per, default=0) if largest else sum(per))


def module_shape(
    name: str,
    *,
    model: DictConfig,
    module: DictConfig,
    layout: ParallelLayout,
    micro_batch: int,
    image_patches: int = 0,
    device: str = "cuda",
) -> ModuleShape:
    """Collect the sizes of module ``name`` that the estimate reads: all from the family's typed
    architecture (:func:`dhp.plan.params.architecture`), none from ``model``'s raw numbers;
    ``layout``: the group's degrees (the plan's); ``device`` (the cluster's) picks the
    linear-attention kernel whose memory is counted (``dhp.ops.linear_attn.planned_kernel``: never
    what the planning host has installed)."""
    whole = architecture(model)
    arch = whole.modules[name]
    par = layout
    tokens = micro_batch * module.seq_len
    chunk = int(module.loss_chunk_tokens)
    if arch.vocab and chunk == 0:
        chunk = default_loss_chunk(arch.vocab, par.tp, tokens)
    return ModuleShape(
        name=name,
        params=arch.params,
        layer_params=arch.block_params,
        largest_param=arch.largest_param,
        layer=arch.layer_shape(),
        layout=layout,
        seq_len=module.seq_len,
        micro_batch=micro_batch,
        ac=parse_ac_mode(module.activation_checkpointing),
        freeze=module.freeze,
        backward=not (module.freeze and not arch.inputs),
        precision=precision(module.mixed_precision),
        attn_implementation=model.attn_implementation,
        loss_chunk_tokens=chunk if arch.vocab else 0,
        image_patches=image_patches if arch.input_row else 0,
        vocab=arch.vocab,
        out_hidden=arch.out_width,
        handoff_width=arch.handoff_width,
        arch=arch,
        trainable=trainable_fraction(name, model=model, module=module),
        delta_rule_fallback=bool(arch.count("linear")) and planned_kernel(device) == TORCH_FALLBACK,
        phases=module_graph(whole).phases(),
    )
