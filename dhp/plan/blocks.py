"""Saved activations and working sets of one block, by its declared kind (pure, no torch).

``dhp/plan/memory.py`` sums these over a module's blocks. Elements per token of one rank's micro-
batch (h hidden, s = tp under LLM sequence parallelism else 1; ``act`` bytes each unless noted).

Token mixer, by :class:`~dhp.models.arch.Attention` kind::

    full / window   off: (4h + 3kv)/tp          selective: (2h + 2kv)/tp     (q, k, v, out; the
                                                                              calibrated dense block)
                    + per-head q/k norms (``qk_norm``, off only):
                      [(q + kv)(4 + a) + 4 (heads + kv heads)] / a / tp (their fp32 inputs and rsqrt,
                      their outputs; ``tests/unit/plan/test_activation_calibration.py``)
    linear          off: (3 (2K+V) + 4V + Hv C)/tp                            selective: (2K + 3V + Hv C)/tp
                    (Gated DeltaNet with flash-linear-attention's chunk kernel, heads split by TP: the
                    conv1d's input and output and the activated q/k/v (2K+V each), the gate z, the
                    core output and the gated RMSNorm's two (V each), the chunked UT-transform matrix
                    A (C per value head); selective keeps the projections' outputs, the core output
                    and A). With transformers' torch fallback (the CPU kernel, ``dhp.ops.linear_attn``)
                    the fitted :func:`fallback_delta_rule_elems` fp32 elements instead.

    K = key heads x d_k, V = value heads x d_v, Hv value heads, C the chunk length.

MLP, by :class:`~dhp.models.arch.Mlp` kind (f = 4 off, 2 selective for a gated MLP; 2 and 1 for an
ungated one, ``Mlp.saved_widths``)::

    dense           f m / tp

    moe, off        k r (h + 4 I)           the rows this rank's experts compute (k = top_k, I =
                                            expert width): the received rows regrouped by expert,
                                            the gate_up output (2I), the activation and the product
                                            (I each). Experts are not TP-sharded (every TP rank runs
                                            its EP rank's experts on all of its tokens), so no /tp
                  + k h                     the combined rows back on the token's rank, kept by the
                                            routing-weight product (the dispatched and received
                                            copies themselves are not saved: the row gathers keep
                                            only their indices)
                  + k                       the routing weights in the activations' dtype
                  + [8 k (2 + 2 r) + 4 (E + k + 1) + 8 k] / a
                                            bytes of fixed width: four int64 routing permutations
                                            (the token order and its inverse, k per token; the
                                            received rows' regrouping and its inverse, k r), the
                                            router's fp32 probabilities (E), top-k values and their
                                            sum, and its int64 top-k indices
                  + 4 shared / tp + h + 1   a shared expert (gated SwiGLU) and its output scaled by
                                            its sigmoid gate (the output and the gate)
    moe, selective  k r (2 I + h)           the experts' matmul outputs (gate_up, down) per row
                  + E                       the router's logits
                  + 2 shared / tp + h + 1   the shared expert's matmul outputs and its gate's
    moe, full       nothing but the block input (the whole block is recomputed)

    Under expert TP (``etp = tp``) each TP rank routes 1/etp of the unit's tokens: every term above
    but the shared expert's (k r (...), k h, k, the fixed-width routing bytes; selective's k r (2 I + h)
    and E) is divided by etp.

    Selective AC recomputes everything else in backward, the dispatch and combine all-to-alls
    included (their outputs are not matmul outputs): ``dhp/plan/timing.py`` charges them again.

    r = rows received per own assignment: 1 with a balanced router (each rank receives, on average,
    as many rows as it sends), ``ep`` under a fully unbalanced one (every token of the EP group
    routed to this rank's experts) -- ``dhp/plan/memory.py`` says which the verdict uses.
    Measured against autograd's saved storages and selective checkpointing's cache of the EP forward
    (``dhp.parallel.ep.ExpertParallelExperts``) on tiny Qwen3-VL-MoE and Qwen3.5-MoE blocks:
    ``tests/unit/plan/test_moe_saved_memory.py`` and ``scripts/bench_planner.py --blocks``.

The load-balancing loss (``dhp.parallel.load_balancing.load_balancing_loss``, every module with MoE blocks):
its fp32 softmax of each MoE block's router logits and int64 top-k indices, 4 E + 8 k bytes per token
and MoE block, plus the fp32 padding mask (4 bytes per token), are saved OUTSIDE the blocks, so every
AC mode keeps them (:func:`router_aux_bytes`).

A linear block's transient while it runs (forward, and backward, which recomputes it): the states at
every chunk boundary, (ceil(S/C) + 1) x Hv/tp x d_k x d_v per sequence (``act`` bytes; the last one is
the recurrent state, what the layer carries instead of a KV cache, in fp32).
"""

from __future__ import annotations

import math

from dhp.models.arch import Attention, Block, Mlp


def fallback_delta_rule_elems(att: Attention) -> float:
    """fp32 elements per token a Gated DeltaNet mixer saves for backward when the delta rule runs as
    transformers' torch fallback (``torch_chunk_gated_delta_rule``: fp32 copies of q/k/v, the C-wide
    decay, UT-system and intra-chunk score rows, and the recurrent state read and written at every
    chunk), all heads: 6K + Hv (11 d_k + 11 d_v + d_k d_v / C + 5.4 C) - C. Fitted to autograd's
    saved storages of transformers' ``Qwen3_5GatedDeltaNet`` on CPU at 7 head/width settings
    (``tests/unit/plan/test_linear_attention_memory.py`` pins it)."""
    c, dk, dv = att.chunk_len, att.head_dim, att.d_v
    return 6 * att.key_width + att.heads * (11 * dk + 11 * dv + dk * dv / c + 5.4 * c) - c


def mixer_saved_elems(
    att: Attention, *, hidden: int, tp: int, selective: bool, fallback: bool = False, act: int = 2
) -> float:
    """Saved elements (of ``act`` bytes) per token of one block's token mixer on one TP rank (table
    above); ``fallback``: a linear block's delta rule runs as the torch fallback (CPU), whose fp32
    intermediates :func:`fallback_delta_rule_elems` counts instead (in every AC mode that saves)."""
    if att.kind == "linear" and fallback:
        return fallback_delta_rule_elems(att) * 4 / act / tp
    if att.kind == "linear":
        k, v, hv, c = att.key_width, att.value_width, att.heads, att.chunk_len
        mix = (2 * k + 3 * v + hv * c) if selective else (3 * (2 * k + v) + 4 * v + hv * c)
    else:
        kv = att.kv_dim
        mix = (2 * hidden + 2 * kv) if selective else (4 * hidden + 3 * kv)
        if att.qk_norm and not selective:  # the per-head norms' fp32 inputs, rsqrt and outputs
            mix += ((att.q_dim + kv) * (FP32_BYTES + act) + FP32_BYTES * (att.heads + att.kv_heads)) / act
    return mix / tp


#: bytes of an int64 routing index and of an fp32 element (the router's probabilities)
INDEX_BYTES, FP32_BYTES = 8, 4


def moe_saved_elems(
    mlp: Mlp, *, hidden: int, tp: int, selective: bool, received: float, act: int, etp: int = 1
) -> float:
    """Saved elements (of ``act`` bytes) per token of one MoE block on one rank (the table above);
    ``etp``: the TP ranks that cut the unit's tokens before the dispatch (1/etp of the routed part)."""
    k, i, h, r, e = mlp.top_k, mlp.intermediate, hidden, received, mlp.experts
    shared = (mlp.saved_widths(selective=selective) * mlp.shared / tp + h + 1) if mlp.shared else 0.0
    if selective:
        return k * r * (2 * i + h) / etp + e / etp + shared
    fixed = INDEX_BYTES * k * (2 + 2 * r) + FP32_BYTES * (e + k + 1) + INDEX_BYTES * k
    return k * r * (h + 4 * i) / etp + k * h / etp + k / etp + shared + fixed / act / etp


def mlp_saved_elems(
    mlp: Mlp, *, hidden: int, tp: int, selective: bool, received: float = 1.0, act: int = 2, etp: int = 1
) -> float:
    """Saved elements (of ``act`` bytes) per token of one block's MLP on one rank (table above);
    ``received``: r; ``etp``: expert TP (an MoE MLP's routed part / etp)."""
    if mlp.kind == "moe":
        return moe_saved_elems(
            mlp, hidden=hidden, tp=tp, selective=selective, received=received, act=act, etp=etp
        )
    return mlp.saved_widths(selective=selective) * mlp.intermediate / tp


def router_aux_bytes(blocks: tuple[Block, ...]) -> float:
    """Bytes per token the load-balancing loss saves outside the blocks (table above): 4 E + 8 k per
    MoE block, and the fp32 padding mask once; 0 without MoE blocks."""
    moe = [b.mlp for b in blocks if b.mlp.kind == "moe"]
    if not moe:
        return 0.0
    return sum(FP32_BYTES * m.experts + INDEX_BYTES * m.top_k for m in moe) + FP32_BYTES


def block_saved_elems(
    block: Block,
    *,
    hidden: int,
    tp: int,
    s: int,
    selective: bool,
    received: float = 1.0,
    fallback: bool = False,
    act: int = 2,
    etp: int = 1,
) -> float:
    """Saved elements per token of one block: the residual region's norms (4h/s, selective 2h/s),
    its mixer and its MLP (``fallback``/``act``: :func:`mixer_saved_elems`; ``etp``: expert TP,
    :func:`moe_saved_elems`)."""
    base = (2 if selective else 4) * hidden / s
    mixer = mixer_saved_elems(
        block.attention, hidden=hidden, tp=tp, selective=selective, fallback=fallback, act=act
    )
    return (
        base
        + mixer
        + mlp_saved_elems(
            block.mlp, hidden=hidden, tp=tp, selective=selective, received=received, act=act, etp=etp
        )
    )


def dispatch_elems(mlp: Mlp, *, hidden: int, received: float, etp: int = 1) -> float:
    """Elements per token of one MoE block's dispatch and combine buffers while it runs: the sorted
    copy of the rank's assignments and the combined rows coming back (k h each), the rows received
    and the expert outputs sent back (k h r each): k h (2 + 2 r); under expert TP each TP rank
    routes 1/etp of the unit's tokens: / etp."""
    return mlp.top_k * hidden * (2 + 2 * received) / etp if mlp.kind == "moe" else 0.0


def dispatch_saved_elems(mlp: Mlp, *, hidden: int, received: float, etp: int = 1) -> float:
    """Of :func:`dispatch_elems`, what AC off keeps for backward (part of :func:`moe_saved_elems`):
    the received rows regrouped by expert and the combined rows, k h (1 + r) / etp. Selective and
    full AC keep none: the exchanges run again in backward."""
    return mlp.top_k * hidden * (1 + received) / etp if mlp.kind == "moe" else 0.0


def delta_rule_states_bytes(att: Attention, *, seqs: float, seq_len: int, tp: int, act: int) -> int:
    """The chunk working set of one linear block on one TP rank (its value heads split by TP): the
    states at every chunk boundary of ``seqs`` sequences of ``seq_len`` tokens, the last of them the
    recurrent state in fp32."""
    if att.kind != "linear":
        return 0
    one = att.state_elems() / tp
    chunks = math.ceil(seq_len / att.chunk_len)
    return int(seqs * one * (chunks * act + 4))
