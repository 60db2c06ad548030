"""Pipeline parallelism in the planner: what each pipeline rank holds and how long the pipeline runs.

A module with ``pp > 1`` (``dhp.layout``) is cut by decoder layers into ``pp x pp_virtual`` stages
(:func:`dhp.layout.stage_cut`); pipeline rank ``r`` holds stages ``r, r + pp, ...`` (loop order). Its
ranks' memory and time are those of a :class:`ModuleShape` restricted to its layers
(:func:`rank_shapes`): the stage blocks' share of the decoder's parameters; the first rank also the
embedding table and the hand-off inputs, the rank of the last stage the final norm, lm_head and
loss (and its logits chunk). Every other degree (dp, fsdp, tp, ep, ZeRO-1) cuts one stage's states
as it cuts the whole module's at pp = 1.

Activations: a pipeline rank holds the saved activations of several micro-batches at once. Counted in
one STAGE's micro-batch (a rank holds ``v = pp_virtual`` stages), rank ``r`` peaks at
(:func:`in_flight_stages`; ``M`` micro-batches per step, the ``pp`` group's ranks; checked against
torch.distributed.pipelining's own action tables in tests/unit/plan/test_pipeline_torch_order.py)::

    gpipe             M                       (every forward, then every backward)
    1f1b              min(pp - r, M)          (pp - r - 1 warm-up forwards, then one forward per backward)
    interleaved_1f1b  min((v - 1) R + 2 (pp - 1 - r) + 1, v M)     R = M / max(1, M // pp) per round
    zero_bubble       min((v - 1) R + pp, v M)       every rank alike: the later ranks' deferred
                                                     weight-gradient passes keep theirs

so a rank's saved bytes are ``in_flight_stages / v`` times its one-micro-batch activations
(:func:`in_flight_micro_batches`). A weight-gradient pass frees what the zero-bubble schedule saved.

Time (:func:`bubble_fraction`): the slowest rank's compute of the M micro-batches, plus the bubble as a
share of it: ``(pp - 1) / M`` for gpipe and 1f1b (fill and drain: pp - 1 micro-batch slots at each
end), ``(pp - 1) / (v M)`` interleaved (each slot is one stage of v: Megatron's interleaved
schedule, Narayanan et al. 2021), and a third of that for zero-bubble (ZB-H1, Qi et al. 2024: the
weight-gradient passes, a third of a micro-batch's work at F = B = W, fill the 1F1B bubble, which
leaves (pp - 1)(F + B - W) of (pp - 1)(F + B + W)). Point-to-point: each stage boundary carries one
micro-batch's hidden states ``rows x hidden`` in the compute dtype forward and its gradient backward
(:func:`p2p_seconds`), over the link between stage groups that are ``stage_world`` ranks apart.
"""

from __future__ import annotations

import dataclasses

from dhp.layout import MULTI_STAGE_SCHEDULES, ParallelLayout
from dhp.models.arch import ModuleArch, ParamCount
from dhp.plan.memory import ModuleShape
from dhp.plan.phases import ModuleTerms, module_terms
from dhp.plan.timing import Link

#: zero-bubble's bubble over 1F1B's at equal input- and weight-gradient passes (see the docstring)
ZERO_BUBBLE_SHARE = 1.0 / 3.0


def rounds(pp: int, micro_batches: int) -> tuple[int, int]:
    """(rounds, micro-batches per round) of the interleaved schedules: ``max(1, M // pp)`` rounds."""
    n = max(1, micro_batches // pp)
    return n, micro_batches // n


def in_flight_stages(schedule: str, *, pp: int, virtual: int, micro_batches: int, rank: int) -> int:
    """Stage micro-batches whose saved activations coexist on pipeline rank ``rank`` at its peak
    (the table in the module docstring)."""
    m, v = max(1, micro_batches), virtual
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(pp - rank, m)
    per_round = rounds(pp, m)[1]
    if schedule == "interleaved_1f1b":
        return min((v - 1) * per_round + 2 * (pp - 1 - rank) + 1, v * m)
    if schedule == "zero_bubble":
        return min((v - 1) * per_round + pp, v * m)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def in_flight_micro_batches(layout: ParallelLayout, *, micro_batches: int, rank: int) -> float:
    """Whole micro-batches of pipeline rank ``rank``'s own layers whose activations coexist."""
    stages = in_flight_stages(
        layout.pp_schedule, pp=layout.pp, virtual=layout.pp_virtual, micro_batches=micro_batches, rank=rank
    )
    return stages / layout.pp_virtual


def bubble_fraction(layout: ParallelLayout, *, micro_batches: int) -> float:
    """The pipeline's idle time as a share of the slowest rank's compute (the module docstring); 0
    without pipeline stages."""
    pp, v, m = layout.pp, layout.pp_virtual, max(1, micro_batches)
    if pp <= 1:
        return 0.0
    if layout.pp_schedule not in MULTI_STAGE_SCHEDULES:
        return (pp - 1) / m
    share = ZERO_BUBBLE_SHARE if layout.pp_schedule == "zero_bubble" else 1.0
    return share * (pp - 1) / (v * m)


def rank_layers(layout: ParallelLayout, layers: int) -> list[list[int]]:
    """The decoder layer indices each pipeline rank holds (its ``pp_virtual`` stages' cuts)."""
    cut = layout.stage_ranges(layers)
    out: list[list[int]] = []
    for r in range(layout.pp):
        idx: list[int] = []
        for s in range(r, layout.num_stages, layout.pp):
            idx += list(range(*cut[s]))
        out.append(idx)
    return out


def _scaled(p: ParamCount, share: float) -> ParamCount:
    return ParamCount(
        tp_sharded=round(p.tp_sharded * share),
        replicated=round(p.replicated * share),
        expert=round(p.expert * share),
    )


def _block_largest(arch: ModuleArch, idx: list[int]) -> int:
    """Elements of the largest tensor among blocks ``idx``: a projection (hidden x the widest of q,
    k/v, the MLP's intermediate or shared width) or an MoE block's fused experts (E x 2I x hidden)."""
    h, out = arch.hidden, 0
    for i in idx:
        b = arch.blocks[i]
        out = max(out, h * b.attention.q_dim, h * b.attention.kv_dim, h * b.mlp.active)
        if b.mlp.kind == "moe":
            out = max(out, b.mlp.experts * 2 * b.mlp.intermediate * h)
    return out


def rank_arch(arch: ModuleArch, layout: ParallelLayout, rank: int) -> ModuleArch:
    """Module ``arch`` as pipeline rank ``rank`` holds it: its stages' blocks with their share of the
    blocks' parameters (the decoder's parameters less the embedding table, the lm_head and the final
    norm, split by block count), the embedding and the hand-off inputs on the first rank, the final
    norm, lm_head and loss (``vocab``, ``head_macs``) on the rank of the last stage."""
    idx = rank_layers(layout, arch.layers)[rank]
    first, last = rank == 0, layout.num_stages - 1 in layout.stages_of(rank * layout.stage_world)
    table = arch.vocab * arch.hidden  # one vocab x hidden matrix (embedding, or lm_head)
    root = ParamCount(tp_sharded=2 * table, replicated=arch.hidden)  # embedding, lm_head, final norm
    blocks = ParamCount(
        tp_sharded=arch.params.tp_sharded - root.tp_sharded,
        replicated=arch.params.replicated - root.replicated,
        expert=arch.params.expert,
    )
    params = _scaled(blocks, len(idx) / arch.layers)
    if first:
        params = params + ParamCount(tp_sharded=table, replicated=0)
    if last:
        params = params + ParamCount(tp_sharded=table, replicated=arch.hidden)
    largest = max(_block_largest(arch, idx), table if first or last else 0)
    return dataclasses.replace(
        arch,
        blocks=tuple(arch.blocks[i] for i in idx),
        params=params,
        largest_param=min(largest, arch.largest_param) or arch.largest_param,
        inputs=arch.inputs if first else (),
        vocab=arch.vocab if last else 0,
        head_macs=arch.head_macs if last else 0.0,
        root_tensors=(1 if first else 0) + (2 if last else 0),
    )


def rank_shapes(shape: ModuleShape) -> list[ModuleShape]:
    """``shape`` as each pipeline rank holds it (:func:`rank_arch`; ``[shape]`` at pp = 1)."""
    lay = shape.layout
    if lay.pp <= 1 or shape.arch is None:
        return [shape]
    out = []
    for r in range(lay.pp):
        arch = rank_arch(shape.arch, lay, r)
        out.append(
            dataclasses.replace(
                shape,
                params=arch.params,
                largest_param=arch.largest_param,
                layer=arch.layer_shape(),
                vocab=arch.vocab,
                loss_chunk_tokens=shape.loss_chunk_tokens if arch.vocab else 0,
                arch=arch,
            )
        )
    return out


def p2p_bytes(shape: ModuleShape) -> int:
    """One micro-batch's hidden states across one stage boundary: its tokens x hidden in the compute
    dtype (every TP rank sends its own copy to its peer; sequence parallelism is refused with pp)."""
    return int(shape.tokens * shape.layer.hidden * shape.precision.act)


def p2p_seconds(shape: ModuleShape, link: Link, *, micro_batches: int) -> float:
    """The step's point-to-point seconds on the pipeline's critical path: a receive before each of a
    rank's stage forwards and backwards (``2 v M``), and the fill and drain across the ``pp - 1``
    boundaries, over the link between stage groups (``stage_world`` ranks apart: inside a node when
    the whole group fits one, else the inter-node link)."""
    lay = shape.layout
    if lay.pp <= 1:
        return 0.0
    one = p2p_bytes(shape) / link.bw(lay.world_size) + link.lat
    return 2.0 * one * (max(1, micro_batches) * lay.pp_virtual + lay.pp - 1)


def receive_buffers(layout: ParallelLayout, rank: int, *, micro_batches: int) -> int:
    """Hidden-state buffers pipeline rank ``rank`` holds through the step: torch's stages allocate one
    receive buffer per micro-batch for the forward input of every stage but the first, and one for the
    output gradient of every stage but the last, when the schedule starts."""
    stages = layout.stages_of(rank * layout.stage_world)
    per_mb = sum((s > 0) + (s < layout.num_stages - 1) for s in stages)
    return per_mb * max(1, micro_batches)


def stage_label(layout: ParallelLayout, layers: int) -> str:
    """The cut as the plan prints it: layers per stage, e.g. ``20+20+20+20``."""
    return "+".join(str(hi - lo) for lo, hi in layout.stage_ranges(layers))


__all__ = [
    "ahead_of_pipeline",
    "bubble_fraction",
    "in_flight_micro_batches",
    "in_flight_stages",
    "p2p_bytes",
    "p2p_seconds",
    "pipeline_terms",
    "rank_arch",
    "rank_layers",
    "rank_shapes",
    "receive_buffers",
    "rounds",
    "stage_label",
]


def ahead_of_pipeline(terms: ModuleTerms, consumer: ParallelLayout, *, micro_batches: int) -> ModuleTerms:
    """A producer's terms when the consumer has pipeline stages: the producer runs the forwards of
    every micro-batch of the step before the pipeline and their backwards after it, so it holds all
    ``micro_batches`` micro-batches' saved activations at once (``terms`` unchanged at pp = 1, for a
    producer without a backward, or with one micro-batch)."""
    if consumer.pp <= 1 or terms.computes_loss or terms.live_micro_batches < 2 or micro_batches < 3:
        return terms
    return dataclasses.replace(terms, live_micro_batches=micro_batches)


def pipeline_terms(shape: ModuleShape, *, micro_batches: int, optimizer_impl: str) -> list[ModuleTerms]:
    """The memory terms of every pipeline rank of ``shape``'s module (``[module_terms(shape)]`` at
    pp = 1): each rank's own layers (:func:`rank_shapes`), its schedule's micro-batches in flight
    (:func:`in_flight_micro_batches`), the hand-off rows on the first rank only, and torch's receive
    buffers of its stage boundaries (:func:`receive_buffers`: one micro-batch's hidden states each)."""
    lay = shape.layout
    if lay.pp <= 1:
        return [module_terms(shape, micro_batches=micro_batches, optimizer_impl=optimizer_impl)]
    out = []
    for r, rs in enumerate(rank_shapes(shape)):
        t = module_terms(rs, micro_batches=micro_batches, optimizer_impl=optimizer_impl)
        p2p = receive_buffers(lay, r, micro_batches=micro_batches) * p2p_bytes(rs)
        out.append(
            dataclasses.replace(
                t,
                fwd_work={**t.fwd_work, "p2p_buffers": p2p},
                bwd_work={**t.bwd_work, "p2p_buffers": p2p} if rs.backward else t.bwd_work,
                handoff=int(rs.tokens * rs.layer.hidden / rs.seq_split * rs.precision.act) if r == 0 else 0,
                live_micro_batches=1,
                computes_loss=True,
                in_flight=in_flight_micro_batches(lay, micro_batches=micro_batches, rank=r),
                stage=r,
            )
        )
    return out
