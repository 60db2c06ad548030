"""Saved activations and working sets of one block, by its declared kind (pure, no torch).

``dhp/plan/memory.py`` sums these over a module's blocks. Elements per token of one rank's micro-
batch (h hidden, s = tp under LLM sequence parallelism else 1; ``act`` bytes each unless noted).

Token mixer, by :class:`~dhp.models.arch.Attention` kind::

    full / window   off: (4h + 3kv)/tp          selective: (2h + 2kv)/tp     (q, k, v, out; the
                                                                              calibrated dense block)
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
    moe             f k I r                 the experts' activations of the rows this rank computes
                                            (k = top_k, I = expert width); experts are not TP-
                                            sharded (every TP rank runs its EP rank's experts on all
                                            of its tokens), so no /tp
                  + k h (2 + 2 r)           dispatch and combine buffers, kept for backward
                                            (``dhp/parallel/ep.py``): the sorted copy of the rank's own
                                            assignments and the combined rows coming back (k h each),
                                            the rows received and the expert outputs sent back (k h r
                                            each)
                  + 2 E                     router logits and probabilities (fp32)
                  + f shared / tp           the always-on shared expert

    r = rows received per own assignment: 1 with a balanced router (each rank receives, on average,
    as many rows as it sends), ``ep`` under a fully unbalanced one (every token of the EP group
    routed to this rank's experts) -- ``dhp/plan/memory.py`` says which the verdict uses.

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
    return mix / tp


def mlp_saved_elems(mlp: Mlp, *, hidden: int, tp: int, selective: bool, received: float = 1.0) -> float:
    """Saved elements per token of one block's MLP on one rank (table above); ``received``: r."""
    f = mlp.saved_widths(selective=selective)
    if mlp.kind != "moe":
        return f * mlp.intermediate / tp
    experts = f * mlp.top_k * mlp.intermediate * received
    buffers = mlp.top_k * hidden * (2 + 2 * received)
    return experts + buffers + 2 * mlp.experts + f * mlp.shared / tp


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
) -> float:
    """Saved elements per token of one block: the residual region's norms (4h/s, selective 2h/s),
    its mixer and its MLP (``fallback``/``act``: :func:`mixer_saved_elems`)."""
    base = (2 if selective else 4) * hidden / s
    mixer = mixer_saved_elems(
        block.attention, hidden=hidden, tp=tp, selective=selective, fallback=fallback, act=act
    )
    return (
        base
        + mixer
        + mlp_saved_elems(block.mlp, hidden=hidden, tp=tp, selective=selective, received=received)
    )


def dispatch_elems(mlp: Mlp, *, hidden: int, received: float) -> float:
    """Elements per token of one MoE block's dispatch and combine buffers (part of
    :func:`mlp_saved_elems`): k h (2 + 2 r)."""
    return mlp.top_k * hidden * (2 + 2 * received) if mlp.kind == "moe" else 0.0


def delta_rule_states_bytes(att: Attention, *, seqs: float, seq_len: int, tp: int, act: int) -> int:
    """The chunk working set of one linear block on one TP rank (its value heads split by TP): the
    states at every chunk boundary of ``seqs`` sequences of ``seq_len`` tokens, the last of them the
    recurrent state in fp32."""
    if att.kind != "linear":
        return 0
    one = att.state_elems() / tp
    chunks = math.ceil(seq_len / att.chunk_len)
    return int(seqs * one * (chunks * act + 4))
