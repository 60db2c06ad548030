"""What tensor parallelism issues in one block, by the block's declared kind (pure, no torch).

``dhp/plan/timing.py`` (seconds) and ``dhp/plan/overheads.py`` (calls) sum these over a module's
blocks. Per block, per TP rank and pass (``tests/unit/parallel/test_tp_collective_counts.py`` counts
what torch issues for each kind)::

                        forward                         backward
    full / window       2 output all-reduces (the       1 all-reduce per column-parallel
    attention           mixer's, the MLP's; an RS + an  projection reading the block input
                        AG each under SP)               (the mixer's: ``tp_input_grads`` less
                                                        the MLP's), + 1 AG per output under SP
    linear (Gated       2 output all-reduces, and 2     the input's grad (1 all-reduce, an RS
    DeltaNet,           weight all-to-alls: the         under SP), the shared norm weight's
    ``dhp/parallel/     in_proj_qkv and conv1d shards   grad (1 all-reduce of d_v elements), the
    linear_attn_tp.py``) moved into the rank's head     MLP's projections, + 1 AG per output
                        layout                          under SP, and the 2 weight all-to-alls
                                                        reversed
    MLP (either)        dense: its column-parallel projections (gate, up: 2; an ungated fc1: 1);
                        MoE: the routed experts and the router are not TP-sharded (no input-grad
                        all-reduce); a shared expert is sharded like a dense gated MLP (2)

The weight all-to-all moves the rank's local shard of ``in_proj_qkv`` ((2K + V) x hidden / tp) and
of ``conv1d`` ((2K + V) x taps / tp), independent of the sequence; the head-layout copy it receives is
saved for backward by the projection and the conv (AC off; selective and full AC recompute it, the
exchange included) and, while the exchange runs, the payload beside it is a second copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from dhp.models.arch import Attention, Block, Mlp, ModuleArch


@dataclass(frozen=True)
class TpBlock:
    """The TP collectives of one block (module docstring): hidden-wide all-reduces of the outputs in
    forward and of input gradients in backward, all-reduces of a replicated weight's gradient, and
    the elements of each weight all-to-all (one per entry, per pass)."""

    fwd_reduces: int
    bwd_reduces: int
    bwd_small: int = 0
    relayout: tuple[float, ...] = ()


def mlp_input_grads(mlp: Mlp) -> int:
    """Column-parallel projections of an MLP reading the block's input (module docstring)."""
    if mlp.kind == "moe":
        return 2 if mlp.shared else 0
    return mlp.matrices - 1


def attention_input_grads(arch: ModuleArch) -> int:
    """The full/window mixer's share of the family's ``tp_input_grads`` (declared for its widest
    block: the mixer's column-parallel projections plus that block's MLP's)."""
    return max(arch.tp_input_grads - max(mlp_input_grads(b.mlp) for b in arch.blocks), 0)


def relayout_elems(att: Attention, *, hidden: int, tp: int) -> tuple[float, ...]:
    """Elements of each weight all-to-all of a linear block on one TP rank (``in_proj_qkv``, and
    ``conv1d`` when the family declares its taps); () for another block or without TP."""
    if att.kind != "linear" or tp <= 1:
        return ()
    proj = att.conv_channels * hidden / tp
    return (proj, att.conv_channels * att.conv_kernel / tp) if att.conv_kernel else (proj,)


def tp_block(block: Block, arch: ModuleArch, tp: int) -> TpBlock:
    """What ``block`` of ``arch`` issues under TP (module docstring)."""
    mlp = mlp_input_grads(block.mlp)
    if block.attention.kind == "linear":
        moves = relayout_elems(block.attention, hidden=arch.hidden, tp=tp)
        return TpBlock(
            fwd_reduces=2, bwd_reduces=1 + mlp, bwd_small=1, relayout=moves + (0.0,) * (2 - len(moves))
        )
    return TpBlock(fwd_reduces=2, bwd_reduces=attention_input_grads(arch) + mlp)
