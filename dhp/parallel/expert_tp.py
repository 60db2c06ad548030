"""Expert TP over the expert axis (``parallel.etp = tp``): the token split around the experts' dispatch.

The TP ranks of a unit hold the same tokens (and the same router output). Under expert TP each keeps
its :func:`tp_rows` of them (:class:`TakeMyRows`: forward a row slice; backward an all-gather of the
rows' gradients, so the replicated input's gradient stays whole and equal on every TP rank), routes
only those through the all-to-all of ``dhp.parallel.ep`` (a group of ep x tp ranks), and the outputs
are gathered back over TP (:class:`GatherRows`: forward an all-gather; backward this rank's rows of the
replicated output's gradient). Memory: one [T, H] gather buffer per MoE layer and direction; the
dispatch and expert activations of ``T / tp`` rows instead of ``T``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_rows(total: int, size: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of the rows TP rank ``rank`` of ``size`` keeps of ``total`` (balanced: the first
    ``total % size`` ranks take one more)."""
    base, extra = divmod(total, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def gather_rows(x: torch.Tensor, total: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The ``total`` rows of every TP rank's :func:`tp_rows` slice ``x``, in rank order (one padded
    ``all_gather_into_tensor``; gloo and NCCL need equal sizes)."""
    size = dist.get_world_size(group)
    per = -(-total // size)
    padded = x.new_zeros((per, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((size * per, *x.shape[1:]))
    dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
    keep = [
        out[r * per : r * per + (hi - lo)]
        for r, (lo, hi) in enumerate(tp_rows(total, size, q) for q in range(size))
    ]
    return torch.cat(keep, dim=0)


class TakeMyRows(torch.autograd.Function):
    """Forward: this TP rank's rows of a tensor every TP rank holds whole. Backward: the rows'
    gradients all-gathered, so the (replicated) input's gradient is whole and equal on every TP rank."""

    @staticmethod
    def forward(ctx, x, group: dist.ProcessGroup):  # type: ignore[override]
        ctx.group, ctx.total = group, x.shape[0]
        lo, hi = tp_rows(x.shape[0], dist.get_world_size(group), dist.get_rank(group))
        return x[lo:hi].clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return gather_rows(grad, ctx.total, ctx.group), None


class GatherRows(torch.autograd.Function):
    """Forward: every TP rank's rows gathered into the whole tensor (replicated). Backward: this rank's
    rows of the gradient (every TP rank holds the same whole gradient of a replicated activation)."""

    @staticmethod
    def forward(ctx, x, total: int, group: dist.ProcessGroup):  # type: ignore[override]
        ctx.bounds = tp_rows(total, dist.get_world_size(group), dist.get_rank(group))
        return gather_rows(x, total, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        lo, hi = ctx.bounds
        return grad[lo:hi].contiguous(), None, None
