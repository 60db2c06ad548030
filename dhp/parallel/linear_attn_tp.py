"""Tensor parallelism of a Gated DeltaNet (linear attention) layer, sharded by heads, as a DTensor style.

The layer is transformers' Gated DeltaNet with separate projections (``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``), a depthwise causal ``conv1d`` over the q|k|v channels, per-value-head
``A_log``/``dt_bias``, a gated RMSNorm over ``head_v_dim`` (one weight shared by every head) and
``out_proj``. Its forward reads the head counts from the module instance and reshapes with ``-1``
heads, so it runs unchanged on this rank's heads once the instance's sizes are the local ones.

Placement after :class:`GatedDeltaNetParallel` on a TP group of N ranks (Hk key heads, Hv value heads,
key_dim = Hk*dk, value_dim = Hv*dv; every parameter a DTensor of transformers' own tensor, so state
dicts, DCP (TP <-> non-TP resharding) and ``full_tensor()`` see the ordinary layout):

- ``in_proj_qkv.weight`` (rows q | k | v = key_dim | key_dim | value_dim) and ``conv1d.weight`` (the
  same channels, (C, 1, K)): stored ``Shard(0)``, i.e. rank r holds rows ``[r*C/N, (r+1)*C/N)`` of HF's
  tensor, which are NOT whole heads of each part. Compute: each forward moves weight rows (never
  activations) with one all-to-all into rank r's head layout ``[q_r; k_r; v_r]`` (its Hk/N key heads of
  q and of k, its Hv/N value heads of v; the reverse all-to-all returns the grads in backward), so the
  projection, the conv (depthwise: channel-local) and the q/k/v split all see whole local heads. Per
  layer and rank that moves at most the local shard, (2*key_dim+value_dim)*hidden/N elements,
  independent of the sequence length.
- ``in_proj_z.weight`` (value heads), ``in_proj_b.weight``, ``in_proj_a.weight``, ``A_log``, ``dt_bias``
  (one per value head): ``Shard(0)``, contiguous heads, used as they are (rank r: value heads
  ``[r*Hv/N, (r+1)*Hv/N)``, which serve key heads ``[r*Hk/N, (r+1)*Hk/N)``: transformers repeats each
  key head for Hv/Hk CONSECUTIVE value heads, so both contiguous cuts agree).
- ``norm.weight``: ``Replicate``; the norm runs on the local heads, so its weight gradient is a partial
  sum per rank and is all-reduced over TP in backward (complete and identical on every rank).
- ``out_proj.weight``: ``Shard(1)`` (row-parallel); its output is summed over TP: all-reduced to a
  replicated hidden state, or with sequence parallelism reduce-scattered into ``Shard(1)`` sequence shards.
- input: replicated hidden states, whose gradient is all-reduced over TP; with sequence parallelism a
  ``Shard(1)`` DTensor that is all-gathered over the sequence (the recurrence needs every position of
  a sequence) and whose gradient is reduce-scattered back.

Memory per rank: the layer's weights, grads and optimizer states are 1/N (except the dv-sized norm
weight); activations inside the layer, the recurrent state (B, Hv/N, dk, dv) and the chunk working set
are 1/N. The head-layout copy of ``in_proj_qkv`` and ``conv1d`` (another 1/N of them) is saved by
autograd from the layer's forward to its backward, unless activation checkpointing recomputes the
layer (then it lives only inside the forward and the recompute).

Composes with FSDP2 applied after TP (the parameters are 2-D DTensors between forwards; the style's
forward swaps in local tensors only for the duration of the layer's forward) and with activation
checkpointing (the recompute repeats the weight all-to-all, a permutation, so it is exact).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from dhp.errors import PlanError
from dhp.parallel.linear_attn_packed import deltanet_forward
from dhp.parallel.llm_tp import check_divides


@dataclass(frozen=True)
class DeltaNetLayout:
    """What one Gated DeltaNet module holds, read off the instance (global sizes).

    ``fused``: parameter FQN (relative to the layer) -> row parts, each split over ranks by heads
    (rank r takes piece r of every part). ``colwise``: parameters whose dim 0 is whole heads in order
    (plain ``Shard(0)``). ``rowwise``: parameters sharded on dim 1. ``shared``: replicated parameters
    applied per head (grad summed over TP). ``sizes``: instance attributes divided by N under TP.
    ``divides``: ``{name: size}`` that N must divide.
    """

    fused: Mapping[str, tuple[int, ...]]
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    shared: tuple[str, ...]
    sizes: Mapping[str, int]
    divides: Mapping[str, int]


def gated_deltanet_layout(module: nn.Module) -> DeltaNetLayout:
    """The layout of transformers' Gated DeltaNet with separate ``in_proj_qkv/z/b/a`` projections.

    PlanError for a layer with another projection layout (e.g. a fused, per-key-head-group interleaved
    ``in_proj_qkvz``, which would shard contiguously by head groups but is not implemented here) or
    with biases (transformers' layer has none; a biased row-parallel output would need its own rule).
    """
    required = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj")
    missing = [n for n in required if not hasattr(module, n)]
    if missing:
        raise PlanError(
            f"{type(module).__name__} is not a Gated DeltaNet with separate in_proj_qkv/z/b/a projections "
            f"(missing {', '.join(missing)}). Fix: give this layer its own TP layout, or leave it out of the "
            "TP plan (use fsdp/dp for it)."
        )
    biased = [n for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "out_proj")
              if getattr(module, n).bias is not None]  # fmt: skip
    if biased:
        raise PlanError(f"Gated DeltaNet TP does not shard biases; {', '.join(biased)} have one.")
    kd, vd = module.key_dim, module.value_dim
    return DeltaNetLayout(
        fused={"in_proj_qkv.weight": (kd, kd, vd), "conv1d.weight": (kd, kd, vd)},
        colwise=("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"),
        rowwise=("out_proj.weight",),
        shared=("norm.weight",),
        sizes={
            "num_k_heads": module.num_k_heads,
            "num_v_heads": module.num_v_heads,
            "key_dim": kd,
            "value_dim": vd,
            "conv_dim": module.conv_dim,
        },
        divides={"linear_num_key_heads": module.num_k_heads, "linear_num_value_heads": module.num_v_heads},
    )


# ---------------------------------------------------------------------------------------------------
# moving rows of a Shard(0) weight into the per-rank head layout


def head_rows(parts: tuple[int, ...], world: int, rank: int) -> list[int]:
    """Pure: the global rows rank ``rank`` computes with: piece ``rank`` of every part, in part order."""
    rows, off = [], 0
    for p in parts:
        step = p // world
        rows += range(off + rank * step, off + (rank + 1) * step)
        off += p
    return rows


@cache
def row_moves(parts: tuple[int, ...], world: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Pure: ``moves[s][r]`` = the LOCAL row indices (in rank s's ``Shard(0)`` block) that rank r needs,
    in r's head-layout order. Rank s's block is rows ``[s*T/N, (s+1)*T/N)``; r's head rows are ascending,
    so concatenating what r receives from s = 0..N-1 gives exactly r's head layout."""
    per = sum(parts) // world
    need = [head_rows(parts, world, r) for r in range(world)]
    return tuple(
        tuple(tuple(g - s * per for g in need[r] if s * per <= g < (s + 1) * per) for r in range(world))
        for s in range(world)
    )


def _exchange(x: torch.Tensor, send: list[list[int]], recv_counts: list[int], group) -> torch.Tensor:
    """Rows ``x[send[r]]`` to rank r, rows from every rank back in rank order (one all-to-all)."""
    idx = torch.tensor([i for rows in send for i in rows], dtype=torch.long, device=x.device)
    payload = x.index_select(0, idx).contiguous()
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, payload, recv_counts, [len(rows) for rows in send], group=group)
    return out


class _ToHeadLayout(torch.autograd.Function):
    """Rank s's ``Shard(0)`` rows -> rank s's head-layout rows (forward); the reverse for the grads."""

    @staticmethod
    def forward(ctx, x, parts, group):  # type: ignore[override]
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        moves = row_moves(parts, world)
        ctx.parts, ctx.group, ctx.rows = parts, group, x.shape[0]
        return _exchange(
            x, [list(m) for m in moves[rank]], [len(moves[s][rank]) for s in range(world)], group
        )

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        moves = row_moves(ctx.parts, world)
        # grad rows are in head-layout order = grouped by owner s, each group in moves[s][rank] order
        counts = [len(moves[s][rank]) for s in range(world)]
        send, start = [], 0
        for c in counts:
            send.append(list(range(start, start + c)))
            start += c
        back = _exchange(grad.contiguous(), send, [len(m) for m in moves[rank]], ctx.group)
        idx = torch.tensor([i for m in moves[rank] for i in m], dtype=torch.long, device=grad.device)
        out = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        return out.index_copy(0, idx, back), None, None


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce (SUM) backward: a replicated value used by per-rank partial work."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce (SUM) forward of per-rank partial outputs; identity backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


# ---------------------------------------------------------------------------------------------------
# the style


def _owner(module: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    owner, _, name = fqn.rpartition(".")
    return (module.get_submodule(owner) if owner else module), name


def _param(module: nn.Module, fqn: str) -> torch.Tensor:
    """The tensor registered as parameter ``fqn``: the Parameter, or the bf16 copy a compute cast
    (``dhp.parallel.precision``) put in its place while the block runs."""
    owner, name = _owner(module, fqn)
    return owner._parameters[name]


def _local_params(module: nn.Module, group) -> dict[str, torch.Tensor]:
    """The plain local tensors the layer's own forward computes with (differentiable views of the
    DTensor parameters): head-layout rows for the fused parameters, the shard for the others."""
    layout: DeltaNetLayout = module._dhp_layout
    out = {}
    for fqn, parts in layout.fused.items():
        x = _param(module, fqn).to_local()
        flat = _ToHeadLayout.apply(x.reshape(x.shape[0], -1), parts, group)
        out[fqn] = flat.reshape(flat.shape[0], *x.shape[1:])
    for fqn in (*layout.colwise, *layout.rowwise):
        out[fqn] = _param(module, fqn).to_local()
    for fqn in layout.shared:
        out[fqn] = _CopyToTP.apply(_param(module, fqn).to_local(), group)
    return out


def _deltanet_tp_forward(self: nn.Module, *args, **kwargs):
    """Gather the input (SP), run transformers' forward on local heads with local tensors
    (``linear_attn_packed.deltanet_forward``: a packed micro-batch one sample at a time), reduce the output."""
    mesh: DeviceMesh = self._dhp_mesh
    group = mesh.get_group()
    sp = self._dhp_sequence_parallel
    key = "hidden_states" if "hidden_states" in kwargs else None
    x = kwargs[key] if key else args[0]
    if sp != isinstance(x, DTensor):
        raise PlanError(
            f"Gated DeltaNet TP was applied with sequence_parallel={sp} but its input is "
            f"{'a plain tensor' if sp else 'a DTensor'}: the decoder plan and deltanet_tp_plan must agree on "
            "sequence_parallel."
        )
    if sp:  # sequence parallel: Shard(1) -> the whole sequence, grad reduce-scattered
        x = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    else:  # replicated: every rank's heads contribute to the input gradient
        x = _CopyToTP.apply(x, group)
    if key:
        kwargs[key] = x
    else:
        args = (x, *args[1:])
    swapped = []
    local = _local_params(self, group)
    narrow = getattr(self, "_dhp_narrow", None)  # context parallelism cuts the local heads further
    local, sizes = narrow(local) if narrow is not None else (local, {})
    before = {a: getattr(self, a) for a in sizes}
    try:
        for fqn, t in local.items():
            owner, name = _owner(self, fqn)
            swapped.append((owner, name, owner._parameters[name]))
            owner._parameters[name] = t  # read by transformers' forward (and causal_conv1d) directly
        for a, v in sizes.items():
            setattr(self, a, v)
        out = deltanet_forward(self, *args, **kwargs)  # packed rows: one sample at a time
    finally:
        for owner, name, param in reversed(swapped):
            owner._parameters[name] = param
        for a, v in before.items():
            setattr(self, a, v)
    if sp:
        return DTensor.from_local(out, mesh, [Partial()]).redistribute(mesh, [Shard(1)])
    return _ReduceFromTP.apply(out, group)


def tp_forward(layer: nn.Module):
    """The TP style's bound forward of ``layer`` (:class:`GatedDeltaNetParallel` applied), else None."""
    forward = layer.__dict__.get("forward")
    return forward if getattr(forward, "__func__", None) is _deltanet_tp_forward else None


class GatedDeltaNetParallel(ParallelStyle):
    """Shard one Gated DeltaNet layer by heads over a 1-D TP mesh (placements: module docstring).

    ``sequence_parallel``: the layer's input arrives as a ``Shard(1)`` DTensor (Megatron SP inside TP)
    and its output leaves as one; otherwise both are replicated plain tensors. The instance's
    ``num_k_heads``, ``num_v_heads``, ``key_dim``, ``value_dim`` and ``conv_dim`` become the local ones.
    """

    def __init__(self, *, sequence_parallel: bool = False, module_name: str = "<module>") -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.module_name = module_name  # for the PlanError's key path

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = gated_deltanet_layout(module)
        check_divides(layout.divides, degree=device_mesh.size(), axis="tp", module=self.module_name)
        tp = device_mesh.size()
        placements = {
            **{f: Shard(0) for f in (*layout.fused, *layout.colwise)},
            **{f: Shard(1) for f in layout.rowwise},
            **{f: Replicate() for f in layout.shared},
        }
        for fqn, placement in placements.items():
            owner, name = _owner(module, fqn)
            param = owner._parameters[name]
            dt = distribute_tensor(param.data, device_mesh, [placement], src_data_rank=self.src_data_rank)
            owner.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
        for attr, size in layout.sizes.items():
            setattr(module, attr, size // tp)
        module._dhp_layout = layout
        module._dhp_mesh = device_mesh
        module._dhp_sequence_parallel = self.sequence_parallel
        module.forward = types.MethodType(_deltanet_tp_forward, module)
        return module


def deltanet_tp_plan(modules: str, *, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The TP plan entry of the Gated DeltaNet layers at FQN glob ``modules`` (one atom per ``*``), e.g.
    ``"language_model.layers.*.linear_attn"``: ``{modules: GatedDeltaNetParallel(...)}``.

    A family merges it into its decoder plan (``dhp.parallel.llm_tp.decoder_tp_plan``, whose
    ``self_attn``/``mlp`` globs then match only the layers that have them). The style owns every
    parameter of the layer, so the layer's Linears match no glob of their own. With
    ``sequence_parallel`` the decoder plan's norms/residual are ``Shard(1)`` and this layer gathers the
    sequence itself, as ``self_attn``'s ``PrepareModuleInput`` does.
    """
    return {modules: GatedDeltaNetParallel(sequence_parallel=sequence_parallel)}


def head_norm_tp_plan(
    attention: str, norms: tuple[str, ...] = ("q_norm", "k_norm")
) -> dict[str, ParallelStyle]:
    """Per-head RMSNorms of a column-parallel attention at FQN glob ``attention`` (one weight over
    head_dim, shared by all heads, applied to (B, S, heads, head_dim)): ``SequenceParallel(sequence_dim=2)``
    marks the input as sharded on the heads dim, so the replicated weight's gradient (a partial sum per
    rank) is summed over the TP group by DTensor."""
    return {f"{attention}.{n}": SequenceParallel(sequence_dim=2, use_local_output=True) for n in norms}


def local_fraction(module: nn.Module) -> dict[str, tuple[int, int]]:
    """``{param FQN: (local numel, global numel)}`` of ``module``'s DTensor parameters (a sharding check)."""
    return {
        n: (p.to_local().numel(), p.numel()) for n, p in module.named_parameters() if isinstance(p, DTensor)
    }


__all__ = [
    "DeltaNetLayout",
    "GatedDeltaNetParallel",
    "deltanet_tp_plan",
    "gated_deltanet_layout",
    "head_norm_tp_plan",
    "head_rows",
    "local_fraction",
    "row_moves",
    "tp_forward",
]
