"""DTensor styles for tensor parallelism of a vision encoder (the uniform-TP baseline); a family's
``parallel_plan`` names them by FQN and ``dhp.parallel.llm_tp.apply_tp`` applies the plan.

Placement with an encoder plan of fused ``qkv`` blocks (styles below) on a TP group of N ranks:
- ``blocks.*.attn.qkv`` (fused, rows laid out q|k|v): stored as a plain ``Shard(0)`` DTensor of
  transformers' tensor (so DCP reshards TP <-> non-TP), computed by :class:`FusedColwiseParallel`: one
  all-to-all of the weight rows gives rank r ``[q_r; k_r; v_r]`` (its H/N heads of each). A plain
  column-parallel Linear would give rank 0 all of q and be wrong. The attention's ``num_heads`` is set to
  H/N, so transformers' own attention forward runs unchanged on the local heads;
- ``blocks.*.attn.proj``, ``blocks.*.mlp.down_proj``, ``merger.mlp.2``: row-parallel (``Shard(1)``), output
  all-reduced to a replicated hidden state;
- ``blocks.*.mlp.{gate,up}_proj``, ``merger.mlp.0``: column-parallel (``Shard(0)``); the MLP width may be
  uneven across ranks (torch.chunk sizes), e.g. an MLP width of 3420 at TP=8, see :class:`UnevenRowwiseParallel`;
- ``patch_embed`` (a Conv3d), norms and ``merger.ln_q``: replicated; their inputs' gradients are
  all-reduced by the column-parallel styles, so their grads are complete and identical on every rank.

Memory per rank: the Linear weights, grads and optimizer states are 1/N; activations inside attention
and the MLPs are 1/N, the residual stream (L, D) stays replicated.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
)

from dhp.errors import ConfigError, ConfigIssue


@dataclass(frozen=True)
class _Move:
    """One block of rows: from (src rank, position there) to (dst rank, position there)."""

    src: int
    src_pos: int
    dst: int
    dst_pos: int


def fused_moves(world: int, num_chunks: int) -> tuple[_Move, ...]:
    """Pure: the block moves from ``Shard(0)`` of a fused (q|k|v) weight to the per-rank head layout.

    The rows split into ``num_chunks * world`` equal blocks ``j`` (HF order). Under ``Shard(0)`` rank
    ``j // num_chunks`` holds block j at position ``j % num_chunks``; in the head layout rank ``j % world``
    needs it at position ``j // world`` (rank r: ``[q_r; k_r; v_r]``).
    """
    return tuple(
        _Move(src=j // num_chunks, src_pos=j % num_chunks, dst=j % world, dst_pos=j // world)
        for j in range(num_chunks * world)
    )


def _transfer(x: torch.Tensor, moves: tuple[_Move, ...], group: dist.ProcessGroup) -> torch.Tensor:
    """Move equal row blocks between ranks as ``moves`` says (one all-to-all); rows in, rows out."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    send = sorted((m for m in moves if m.src == rank), key=lambda m: (m.dst, m.src_pos))
    recv = sorted((m for m in moves if m.dst == rank), key=lambda m: (m.src, m.src_pos))
    rows = x.shape[0] // len(send)
    blocks = x.reshape(len(send), rows, *x.shape[1:])
    payload = torch.cat([blocks[m.src_pos] for m in send])
    in_splits = [rows * sum(m.dst == t for m in send) for t in range(world)]
    out_splits = [rows * sum(m.src == t for m in recv) for t in range(world)]
    got = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(got, payload, out_splits, in_splits, group=group)
    order = sorted(range(len(recv)), key=lambda i: recv[i].dst_pos)
    return got.reshape(len(recv), rows, *x.shape[1:])[order].reshape(len(recv) * rows, *x.shape[1:])


class _Transfer(torch.autograd.Function):
    """:func:`_transfer` with the reverse moves as its backward (a permutation: exact)."""

    @staticmethod
    def forward(ctx, x, moves, group):  # type: ignore[override]
        ctx.moves, ctx.group = moves, group
        return _transfer(x, moves, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        back = tuple(_Move(src=m.dst, src_pos=m.dst_pos, dst=m.src, dst_pos=m.src_pos) for m in ctx.moves)
        return _transfer(grad.contiguous(), back, ctx.group), None, None


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce (SUM) backward: the input of a column-parallel Linear."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _fused_colwise_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Forward of a fused column-parallel Linear: local heads' rows of every chunk, local output."""
    group, moves = self._dhp_tp_group, self._dhp_moves
    weight = _Transfer.apply(self.weight.to_local(), moves, group)
    bias = None if self.bias is None else _Transfer.apply(self.bias.to_local(), moves, group)
    return F.linear(_CopyToTP.apply(x, group), weight, bias)


class FusedColwiseParallel(ColwiseParallel):
    """Column-parallel for a Linear whose output rows are ``num_chunks`` fused blocks (q|k|v).

    Storage: weight and bias are a plain ``Shard(0)`` DTensor of transformers' tensor, so state dicts,
    DCP (TP <-> non-TP resharding) and optimizers see an ordinary row-sharded parameter. Compute: each
    forward moves the weight rows (not activations) with one all-to-all into rank r's head layout
    ``[q_r; k_r; v_r]`` (3*out/N rows; in backward the reverse all-to-all returns the grads), so the
    local output is this rank's heads of q, k and v. Per block and rank that moves ~(N-1)/N of the
    local weight shard, independent of the sequence length. Input: replicated, gradient all-reduced.
    """

    def __init__(self, *, num_chunks: int = 3) -> None:
        super().__init__()
        self.num_chunks = num_chunks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError("FusedColwiseParallel supports nn.Linear only")
        world = device_mesh.size()
        if module.out_features % (self.num_chunks * world):
            raise ConfigError(
                [ConfigIssue("modules.<encoder>.parallel.tp", world, f"must divide {module.out_features // self.num_chunks}",
                             "pick a tp that divides the encoder hidden size")]
            )  # fmt: skip
        distribute_module(module, device_mesh, self._partition_linear_fn)
        module._dhp_tp_group = device_mesh.get_group()
        module._dhp_moves = fused_moves(world, self.num_chunks)
        module.forward = types.MethodType(_fused_colwise_forward, module)
        return module


class UnevenRowwiseParallel(RowwiseParallel):
    """Row-parallel Linear whose input features may not divide by N (torch.chunk sizes: ceil, last smaller).

    The stock style infers the input's global width as ``local * N``, which is wrong for uneven shards;
    here the global shape comes from the (already distributed) weight, so e.g. the encoder MLP width
    3420 runs at TP=8 (seven ranks 428, one 424). Output: all-reduced, replicated.
    """

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):  # type: ignore[override]
        x = inputs[0]
        if isinstance(x, DTensor):
            return x
        shape = torch.Size((*x.shape[:-1], mod.weight.shape[1]))
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(x, device_mesh, input_layouts, run_check=False, shape=shape, stride=stride)
