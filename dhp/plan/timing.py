"""Step-time model: FLOPs at an achieved fraction of peak, communication over the links, schedule.

Per module rank and micro-batch (T = tokens the rank's layers see, N = matmul parameters per
token, h hidden, span = attention span per query):

    matmul fwd   = 2 * T * N / tp                 N: vision blocks (qkv 3h^2, proj h^2, MLP 3hm) +
                                                  merger / merge^2 per patch; LLM blocks + lm_head
    attention fwd = 4 * T * span * h / tp         vision: span = one image (full-attention blocks)
                                                  or a window (the others); LLM: S/2 (causal)
    delta rule fwd = T * sum over linear blocks of Attention.delta_rule_flops / tp   (chunked gated
                   delta rule, linear in S: per head C (2.5 d_k + 1.5 d_v) + 3 d_k d_v MACs a token;
                   ``dhp/models/arch.py``), at the attention rate of a span of one chunk C
    backward     = 2 x matmul + 2.5 x (attention + delta rule)   (flash recomputes the scores in
                   backward; the chunk kernel recomputes its states)
    MoE: N counts the ACTIVE experts (top-k) and the router, never the idle experts; the routed
    experts are not TP-sharded (``ParamCount.expert``: whole on every TP rank), so with etp=1 every
    TP rank computes them for all of its tokens: their matmul is 2 * T * N_experts / etp (no /tp;
    under expert TP, etp = tp, each TP rank routes 1/tp of the unit's tokens and no TP rank repeats
    another's expert work)
    recompute    = the checkpointed blocks' forward again (full, every_n); selective recomputes
                   only elementwise ops (no matmul FLOPs)

    compute_s = matmul / (peak * matmul_efficiency * g/(g + gemm_half_flops))
              + attention / (peak * attention_efficiency * span/(span + ATTN_HALF_SPAN))
      g = one MLP up-projection GEMM of the rank (2 * T * h * m/tp): small GEMMs (narrow TP shards,
      few tokens) do not fill the device (``cluster.gemm_half_flops``: 2 GFLOP on an H100, about a
      1024^3 GEMM; tiny on a CPU); span/(span + 128): a 64-patch window fills half a tile.

Communication (bytes per rank, ring algorithms, bw = link GB/s * comm_efficiency, lat per hop):

    all-reduce   2 (n-1)/n * bytes / bw + 2 (n-1) lat      TP: 2 per block fwd; bwd 1 per column-
                                                           parallel input (tp_input_grads: q, k, v,
                                                           gate, up = 5 unfused; a Gated DeltaNet
                                                           mixer: its input and its norm weight,
                                                           ``tp_blocks.py``) + 2 recompute;
                                                           RS+AG under sequence_parallel: same volume
                                                           (+ 2 AG of the outputs' grads in bwd)
    all-to-all   a Gated DeltaNet block under TP: its in_proj_qkv and conv1d shards into the head
                 layout, 2 per pass, (2K + V) x hidden / tp elements (+ the conv's taps), again in
                 backward where the block's exchanges are recomputed
    all-to-all   (n-1)/n * bytes / bw + (n-1) lat          Ulysses: q, k, v, out per full-attn block
    all-gather   (n-1)/n * bytes / bw + (n-1) lat          FSDP: every block fwd and bwd; RS of grads
                                                           (the non-expert parameters only)
    all-to-all   per MoE block, EP dispatch and combine: T * top_k * h * a bytes each way over the
                 ep x etp ranks (``expert_group``), each sending 1/etp of the unit's rows; forward 2,
                 backward 2 (the autograd of each is the reverse exchange), + 2 per block whose
                 exchanges run again in backward: the checkpointed ones under full / every_n, every
                 block under selective (``memory.recomputed_exchanges``; the same rule re-issues
                 Ulysses' all-to-alls). The EP group is ``ep`` units strided by tp (``dhp/parallel/
                 ep.py``: ep innermost of the folded dp x fsdp x cp x sp; with etp = tp every TP rank
                 of those units), i.e. it spans ep * tp consecutive GPUs (``ep_span``): intra-node
                 when they sit in one node, else the inter-node link
    expert TP:   per MoE block an all-gather of the MoE output over the TP group (T h a bytes out),
                 forward, and its reverse (a reduce-scatter of the same size) in backward; the
                 checkpointed blocks' forward issues it once more in backward
    expert FSDP: per MoE block an all-gather of its local experts (1/(ep x etp) of them, compute
                 dtype) over edp in forward and again in backward, and a reduce-scatter of their
                 grads (reduce dtype) in backward, on the link edp spans (its ranks are ep x tp apart:
                 the whole group's GPUs); overlapped with compute like the dense FSDP collectives
                 (counted in ``fsdp``)
    CP (``cp_comm_s``): per full block an all-gather of K and V (2 S kv/tp elements) forward, again
                 in backward (the checkpointed attention) + an all-reduce of their gathered grads;
                 per linear block an all-gather of the input + an all-reduce of the output each way;
                 over cp ranks strided by sp * tp; never overlapped (blocking, consumed at once).
                 Compute under CP: T = the rank's 1/cp of the padded rows (the load-balanced
                 chunks give every rank the same work); a full block's span is the whole row S (a
                 masked kernel over every gathered key) and its attention forward runs once more
                 in backward; the dense grads are all-reduced over cp once per step
    EP expert grads: all-reduce over the edp = dp * fsdp * cp * sp / ep ranks holding the same
                 experts; with zero=1 the experts' owners also broadcast them over edp after the step;
                 neither under expert FSDP (its reduce-scatter in each backward replaces them)
    FSDP overlaps its collectives with compute: exposed = max(comm - compute, comm / blocks),
    compute at the profile's achieved efficiencies (``estimate.module_features``)
    DP/SP grad all-reduce and the ZeRO-1 parameter broadcast: once per step, not overlapped
    hand-off: merged tokens x LLM hidden x a, each way; cuda_ipc moves nothing (an HBM copy)

The link: intra-node (NVLink) when the group fits in a node, else inter-node per GPU
(inter_node_gbps / gpus_per_node). Optimizer: AdamW reads p, g, m, v and writes p, m, v, plus the
grad norm and clip read/write the grads: bytes / (hbm_gbps * memory_efficiency).

Schedule: collocated runs everything on the same GPUs, one after the other:
    step = n_mb * (v_fwd + v_bwd + l_fwd + l_bwd + 2 handoff) + sync + optimizer (both modules).
Disaggregated is a two-stage pipeline over the n_mb micro-batches:
    step = n_mb * max(V, L) + min(V, L) + max(sync + optimizer),  V = v_fwd + v_bwd,
    L = l_fwd + l_bwd + 2 handoff; the faster stage idles (reported as ``idle_s``).
Both add the driver's own time, ``dispatch_overhead_s`` per micro-batch. On a CPU cluster
(``host_cores`` > 0) a rank's phases stretch by max(1, processes / cores): every rank process of
the plan, at work or waiting, and the driver (``estimate.busy_processes``).

Defaults: the schema's (``ClusterConfig``) are round priors; the GPU profiles in conf/cluster set
their efficiencies from published training measurements (``scripts/check_public_anchors.py``; each
YAML constant says whether it is fitted there or a prior, and the profile's ``provenance`` the error).
``dhp calibrate`` replaces them with least-squares fits from measured runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from dhp.models.arch import model_flops
from dhp.plan.memory import (
    ModuleShape,
    checkpointed_blocks,
    cp_full_blocks,
    non_expert_params,
    rank_params,
    recomputed_exchanges,
)
from dhp.plan.params import architecture
from dhp.plan.tp_blocks import tp_block

ATTN_HALF_SPAN = 128.0
ATTN_BWD_FACTOR = 2.5


# ---- FLOPs ------------------------------------------------------------------------------------
def matmul_params_per_token(shape: ModuleShape) -> float:
    """N: multiply-accumulates per token of the module's matmuls: every block's q/o, k/v and active
    MLP (the family's typed blocks), plus its head (merger / merge, or lm_head)."""
    return shape.arch.block_macs() + shape.arch.head_macs


def attention_spans(shape: ModuleShape) -> list[tuple[int, float]]:
    """(blocks, span per query) groups from each block's declared attention (full over an image or,
    causal, S/2; a window; a linear state). Under context parallelism a full block's queries attend
    over all ``S`` gathered keys of the padded row with an explicit mask (``dhp.parallel.cp``), which
    the kernel cannot skip: span ``S``, the same on every CP rank (the load-balanced chunks)."""
    if not cp_full_blocks(shape):
        return shape.arch.spans(seq_len=shape.seq_len, sample=shape.image_patches or shape.seq_len)
    out: dict[float, int] = {}
    for b in shape.arch.blocks:
        att = b.attention
        span = float(shape.row_len) if att.kind != "linear" else 0.0
        out[span] = out.get(span, 0) + 1
    return [(n, s) for s, n in out.items()]


@dataclass(frozen=True)
class Flops:
    """FLOPs of one rank and micro-batch, split so each part gets its own efficiency."""

    matmul_fwd: float
    attn_fwd: float
    recompute_matmul: float
    recompute_attn: float
    attn_span: float  # FLOP-weighted mean span of the score-based blocks (the attention efficiency)
    linear_fwd: float = 0.0  # the linear blocks' chunked delta rule
    recompute_linear: float = 0.0
    linear_span: float = 1.0  # the delta rule's tile: its chunk length

    @property
    def fwd(self) -> float:
        return self.matmul_fwd + self.attn_fwd + self.linear_fwd

    @property
    def bwd(self) -> float:
        return (
            2 * self.matmul_fwd
            + ATTN_BWD_FACTOR * (self.attn_fwd + self.linear_fwd)
            + self.recompute_matmul
            + self.recompute_attn
            + self.recompute_linear
        )


def blocks_matmul_fwd(shape: ModuleShape, tokens: float) -> float:
    """Forward matmul FLOPs of the blocks on one rank: TP shards all but the routed experts, which
    every TP rank runs whole on all of its tokens at etp=1, and on its 1/etp of them under expert TP."""
    tp, etp, arch = shape.layout.tp, shape.layout.etp, shape.arch
    experts = arch.expert_macs()
    return 2.0 * tokens * ((arch.block_macs() - experts) / tp + experts / etp)


def module_flops(shape: ModuleShape, tokens: float) -> Flops:
    """FLOPs of one rank per micro-batch when its layers see ``tokens`` tokens (formulas above)."""
    tp = shape.layout.tp
    block_mm = blocks_matmul_fwd(shape, tokens)  # recompute re-runs blocks, not the head
    mm = block_mm + 2.0 * tokens * shape.arch.head_macs / tp
    h = shape.layer.hidden
    attn, weighted = 0.0, 0.0
    for blocks, span in attention_spans(shape):
        f = 4.0 * tokens * span * h * blocks / tp
        attn += f
        weighted += f * span
    linear = tokens * shape.arch.delta_rule_flops() / tp  # value heads split by TP
    chunks = [b.attention.chunk_len for b in shape.arch.blocks if b.attention.kind == "linear"]
    frac = checkpointed_blocks(shape.ac, shape.layer.layers) / shape.layer.layers if shape.backward else 0.0
    # CP checkpoints every full block's attention: backward runs its forward once more
    again = 1.0 if cp_full_blocks(shape) and shape.backward else 0.0
    return Flops(
        matmul_fwd=mm,
        attn_fwd=attn,
        recompute_matmul=frac * block_mm,
        recompute_attn=(frac + again) * attn,
        attn_span=weighted / attn if attn else 1.0,
        linear_fwd=linear,
        recompute_linear=frac * linear,
        linear_span=float(max(chunks, default=1)),
    )


# ---- communication ---------------------------------------------------------------------------
def all_reduce_s(nbytes: float, n: int, bw: float, lat: float) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


def all_gather_s(nbytes: float, n: int, bw: float, lat: float) -> float:
    """All-gather (or reduce-scatter) producing ``nbytes`` per rank."""
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / bw + (n - 1) * lat


def all_to_all_s(nbytes: float, n: int, bw: float, lat: float) -> float:
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / bw + (n - 1) * lat


@dataclass
class Link:
    """Bandwidths (bytes/s, efficiency applied) and the per-hop latency of a cluster."""

    intra: float
    inter: float
    lat: float
    gpn: int

    def bw(self, span_gpus: int) -> float:
        return self.intra if span_gpus <= self.gpn else self.inter


def link_of(cluster: DictConfig) -> Link:
    eff = cluster.comm_efficiency
    return Link(
        intra=cluster.intra_node_gbps * 1e9 * eff,
        inter=cluster.inter_node_gbps * 1e9 * eff / cluster.gpus_per_node,
        lat=cluster.latency_us * 1e-6,
        gpn=cluster.gpus_per_node,
    )


def module_comm(shape: ModuleShape, tokens: float, link: Link) -> dict[str, float]:
    """Seconds of collectives of one rank per micro-batch: fwd, bwd (incl. recompute), fsdp."""
    par, a, h, lay = shape.layout, shape.precision.act, shape.layer.hidden, shape.layer
    ck = checkpointed_blocks(shape.ac, lay.layers) if shape.backward else 0
    again = recomputed_exchanges(shape.ac, lay.layers)  # all-to-alls re-issued in backward
    fwd = bwd = 0.0
    if par.sp > 1:
        n_full = shape.arch.sp_exchange_blocks
        one = all_to_all_s(tokens * h * a, par.sp, link.bw(par.sp), link.lat)
        fwd += 4 * n_full * one
        bwd += (4 * n_full + 4 * n_full * again / lay.layers) * one if shape.backward else 0.0
    if par.tp > 1:
        tp_fwd, tp_bwd = tp_comm_s(shape, tokens, link, ck=ck, again=again)
        fwd += tp_fwd
        bwd += tp_bwd if shape.backward else 0.0
    if par.cp > 1:
        cp_fwd, cp_bwd = cp_comm_s(shape, tokens, link, ck=ck)
        fwd += cp_fwd
        bwd += cp_bwd if shape.backward else 0.0
    a2a_fwd, a2a_bwd = moe_all_to_all_s(shape, tokens, link)
    fwd += a2a_fwd
    bwd += a2a_bwd
    etp_fwd, etp_bwd = etp_output_gather_s(shape, tokens, link, ck=ck)
    fwd += etp_fwd
    bwd += etp_bwd
    fsdp = expert_fsdp_s(shape, link)
    if par.fsdp > 1:
        span = par.span("fsdp")
        dense, dense_block = non_expert_params(shape)
        layer = dense_block.per_tp_rank(par.tp)
        root = dense.per_tp_rank(par.tp) - lay.layers * layer
        gather = all_gather_s((lay.layers * layer + root) * a, par.fsdp, link.bw(span), link.lat / 1)
        fsdp += gather * (2 if shape.backward else 1)
        if shape.backward and not shape.freeze:
            fsdp += all_gather_s(
                (lay.layers * layer + root) * shape.precision.reduce, par.fsdp, link.bw(span), link.lat
            )
    return {"fwd": fwd, "bwd": bwd, "fsdp": fsdp, "a2a": a2a_fwd + a2a_bwd}


def tp_comm_s(shape: ModuleShape, tokens: float, link: Link, *, ck: int, again: int) -> tuple[float, float]:
    """(forward, backward) seconds of one rank's TP collectives per micro-batch, block by block
    (``dhp/plan/tp_blocks.py``): the hidden-wide all-reduces (TP ranks see every token; SP-in-TP's
    RS + AG move the same volume; SP adds the all-gathers of the two outputs' grads, one AR's bytes),
    the tiny all-reduces of replicated weights' grads, and a linear block's weight all-to-alls
    (again in backward where the exchanges are recomputed: ``again`` blocks; ``ck`` checkpointed blocks
    re-issue their 2 forward all-reduces)."""
    par, a, h = shape.layout, shape.precision.act, shape.layer.hidden
    bw = link.bw(par.tp)
    one = all_reduce_s(tokens * h * a, par.tp, bw, link.lat)
    small = all_reduce_s(4.0, par.tp, bw, link.lat)  # a few elements: the latency
    blocks = [tp_block(b, shape.arch, par.tp) for b in shape.arch.blocks]
    moves = sum(all_to_all_s(n * a, par.tp, bw, link.lat) for c in blocks for n in c.relayout)
    sp = 1 if par.sequence_parallel else 0
    fwd = sum(c.fwd_reduces for c in blocks) * one + moves
    hidden = sum(c.bwd_reduces for c in blocks) + sp * len(blocks) + 2 * ck  # exact: integers
    bwd = hidden * one + sum(c.bwd_small for c in blocks) * small + moves * (1 + again / len(blocks))
    return fwd, bwd


def cp_comm_s(shape: ModuleShape, tokens: float, link: Link, *, ck: int) -> tuple[float, float]:
    """(forward, backward) seconds of one rank's context-parallel collectives per micro-batch over the
    cp ranks (strided by sp x tp: the link of ``cp * sp * tp`` consecutive GPUs). ``tokens``: the
    rank's (1/cp of the padded rows); ``S = cp x tokens`` is what a gather produces.

    - full block: forward all-gathers K and V (``2 S kv/tp`` elements out); backward re-gathers them
      for the checkpointed attention and all-reduces the gathered gradient of K and V (the runtime's
      ``_GatherTokens`` sums it whole, twice a reduce-scatter's volume);
    - linear block: forward all-gathers the input and all-reduces the heads' partial output (``S h``
      each); backward all-reduces the gathered input's gradient and all-gathers the output's;
    - a block AC checkpoints issues its forward collectives once more in backward (``ck`` of them).

    None is overlapped: each is a blocking collective whose result the next op reads (no prefetch
    in ``dhp.parallel.cp``), so all of it is exposed."""
    par, a, arch = shape.layout, shape.precision.act, shape.arch
    cp, bw, lat = par.cp, link.bw(par.span("cp")), link.lat
    whole = tokens * cp
    kv = whole * 2 * shape.layer.kv_dim / par.tp * a
    full_f = all_gather_s(kv, cp, bw, lat)
    full_b = all_gather_s(kv, cp, bw, lat) + all_reduce_s(kv, cp, bw, lat)
    x = whole * arch.hidden * a
    lin_f = all_gather_s(x, cp, bw, lat) + all_reduce_s(x, cp, bw, lat)
    lin_b = lin_f
    n_lin = arch.count("linear")
    n_full = arch.layers - n_lin
    fwd = n_full * full_f + n_lin * lin_f
    redo = ck / arch.layers
    return fwd, n_full * full_b + n_lin * lin_b + redo * fwd


def moe_all_to_all_s(shape: ModuleShape, tokens: float, link: Link) -> tuple[float, float]:
    """(forward, backward) seconds of one rank's EP dispatch + combine all-to-alls per micro-batch,
    over every MoE block (formulas above): over the ep x etp ranks of the group, each rank sending
    the rows of its 1/etp of the unit's tokens; 0 when the group is one rank."""
    par, arch = shape.layout, shape.arch
    group, etp = par.expert_group, par.etp
    if group <= 1 or arch is None or not arch.moe_blocks:
        return 0.0, 0.0
    a, h = shape.precision.act, arch.hidden
    bw = link.bw(par.ep_span)
    fwd = bwd = 0.0
    for b in arch.blocks:
        if b.mlp.kind == "moe":
            one = all_to_all_s(tokens * b.mlp.top_k * h * a / etp, group, bw, link.lat)
            fwd += 2 * one
            bwd += 2 * one
    again = recomputed_exchanges(shape.ac, shape.layer.layers) / shape.layer.layers  # selective: all
    return fwd, (bwd + again * fwd if shape.backward else 0.0)


def etp_output_gather_s(shape: ModuleShape, tokens: float, link: Link, *, ck: int) -> tuple[float, float]:
    """(forward, backward) seconds of expert TP's MoE-output exchange per micro-batch: each MoE block
    all-gathers its output over the TP group (``tokens x h`` in the compute dtype out), backward
    reduce-scatters its gradient (the same volume), and a checkpointed block's recompute gathers it
    again (``ck`` of the blocks); 0 at etp=1."""
    par, arch = shape.layout, shape.arch
    if par.etp <= 1 or arch is None or not arch.moe_blocks:
        return 0.0, 0.0
    one = all_gather_s(tokens * arch.hidden * shape.precision.act, par.etp, link.bw(par.tp), link.lat)
    fwd = arch.moe_blocks * one
    bwd = fwd * (1 + ck / shape.layer.layers) if shape.backward else 0.0
    return fwd, bwd


def expert_fsdp_s(shape: ModuleShape, link: Link) -> float:
    """Seconds of expert FSDP's collectives per micro-batch (formulas above), before overlap: per MoE
    block an all-gather over edp of its local experts in forward and again in backward, and the
    reduce-scatter of their grads in backward; 0 without expert FSDP."""
    par, arch = shape.layout, shape.arch
    if not par.expert_fsdp or arch is None or not arch.moe_blocks or par.edp <= 1:
        return 0.0
    per_block = shape.params.expert / arch.moe_blocks / par.expert_group  # one block's local experts
    bw = link.bw(par.world_size)  # edp ranks are ep x tp apart: the group's whole span
    gather = all_gather_s(per_block * shape.precision.act, par.edp, bw, link.lat)
    out = gather * (2 if shape.backward else 1)
    if shape.backward and not shape.freeze:
        out += all_gather_s(per_block * shape.precision.reduce, par.edp, bw, link.lat)
    return arch.moe_blocks * out


def grad_sync_s(shape: ModuleShape, link: Link, world: int) -> float:
    """Once per step: DP/SP gradient all-reduce, HSDP replica all-reduce, ZeRO-1 broadcast."""
    if shape.freeze:
        return 0.0
    par, pr = shape.layout, shape.precision
    local, experts = rank_params(shape)
    t = 0.0
    edp = par.edp  # the folded dp x fsdp x cp x sp ranks over ep
    replicated = experts and edp > 1 and not par.expert_fsdp  # expert FSDP: reduce-scattered in bwd
    if replicated:  # expert grads: SUM over the ranks holding the same experts
        t += all_reduce_s(experts * pr.grad, edp, link.bw(world), link.lat)
    if par.sp > 1:
        t += all_reduce_s(local * pr.grad, par.sp, link.bw(par.span("sp")), link.lat)
    if par.cp > 1:  # each CP rank's gradient is its own tokens' (dhp.parallel.optim.finalize_grads)
        t += all_reduce_s(local * pr.grad, par.cp, link.bw(par.span("cp")), link.lat)
    if par.dp > 1:
        t += all_reduce_s(local * pr.grad, par.dp, link.bw(world), link.lat)
    if par.optimizer_shards > 1:
        t += all_gather_s(local * pr.param, par.optimizer_shards, link.bw(world), link.lat)
    if replicated and par.expert_optimizer_shards > 1:  # ZeRO-1's expert owners broadcast over edp
        t += all_gather_s(experts * pr.param, edp, link.bw(world), link.lat)
    return t


def optimizer_s(shape: ModuleShape, cluster: DictConfig) -> float:
    """AdamW + grad norm + clip, memory bound (bytes in the module docstring)."""
    if shape.freeze:
        return 0.0
    par, pr = shape.layout, shape.precision
    dense, experts = rank_params(shape)
    local = dense + experts
    owned = dense / par.optimizer_shards + experts / par.expert_state_split
    nbytes = owned * (2 * pr.param + pr.grad + 2 * pr.optimizer) + 3 * local * pr.grad
    return nbytes / (cluster.hbm_gbps * 1e9 * cluster.memory_efficiency)


def palm_model_flops(config: DictConfig, images: list[int], seq_lens: list[int]) -> float:
    """Model FLOPs of a step by the PaLM formula from the family's typed architecture: the one
    formula (``dhp.models.arch.model_flops``) that ``metrics.jsonl``'s MFU counts too."""
    frozen = {name: bool(mod.freeze) for name, mod in config.modules.items()}
    return model_flops(architecture(config.model), images=images, seq_lens=seq_lens, frozen=frozen)
