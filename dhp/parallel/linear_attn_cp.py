"""Context parallelism of a Gated DeltaNet (linear attention) layer: the sequence gathered, the heads cut.

The gated delta rule is a recurrence along the whole sequence (and its causal conv1d looks back a few
tokens), so a CP rank cannot run it on its own tokens alone. Instead, for each Gated DeltaNet layer:

- the layer's input, this rank's tokens (B, S/cp, H), is all-gathered over the context group into the
  whole sequence in global order (the gradient of every rank's copy is summed back to the owner);
- transformers' own forward runs on that whole sequence with only this rank's ``1/cp`` of the heads:
  the projections' rows of its key and value heads (the q | k | v parts of ``in_proj_qkv`` and
  ``conv1d`` cut by heads as under TP, ``dhp.parallel.linear_attn_tp.head_rows``), its value heads'
  ``in_proj_z/b/a``, ``A_log``, ``dt_bias`` and ``out_proj`` columns; the shared norm weight whole;
- the output, a partial sum over the head groups (``out_proj`` is row-parallel over them), is summed
  over the context group and each rank keeps its own tokens.

Exact: every head sees its whole sequence, state reset and conv included, as unsplit. Parameters stay
whole and replicated over cp (their views are cut for the forward only), so each rank's gradient is
non-zero on its heads' rows, and the SUM over cp that ``finalize_grads`` does for every replicated
parameter gives the whole gradient. Under TP the cut applies inside each TP rank's heads. A packed
micro-batch: the layer's mask entry is the whole micro-batch's sample ids, so on the gathered sequence
each sample runs on its own (``dhp.parallel.linear_attn_packed``), as unsplit.

Memory and traffic per layer and rank: the gathered input, ``S * H`` elements (saved for backward
unless activation checkpointing recomputes the layer), and the layer's own activations at ``S`` tokens
for ``1/cp`` of the heads (as many as ``S/cp`` tokens of all heads); the all-gather of the input and
the all-reduce of the output each move ``S * H`` elements (and their reverses in backward).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.distributed as dist
from torch import nn

from dhp.ops.context import rank_index
from dhp.parallel.linear_attn_packed import deltanet_forward
from dhp.parallel.linear_attn_tp import (
    DeltaNetLayout,
    check_divides,
    gated_deltanet_layout,
    head_rows,
    tp_forward,
)


def _global_order(seq: int, cp: int, device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the permutation putting the rank-major gathered tokens into global order, each rank's indices)."""
    ranks = [rank_index(seq, cp, r, device) for r in range(cp)]
    return torch.argsort(torch.cat(ranks)), ranks


class _GatherSequence(torch.autograd.Function):
    """(B, L, H) of this rank -> (B, cp * L, H) of every rank in global token order; backward: the sum
    of every rank's gradient at this rank's tokens."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        inv, ranks = _global_order(cp * x.shape[1], cp, x.device)
        ctx.group, ctx.own = group, ranks[rank]
        return torch.cat(parts, dim=1)[:, inv]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.own], None


class _SumToOwnTokens(torch.autograd.Function):
    """(B, S, H) partial sums over the context group -> their sum at this rank's tokens (B, S/cp, H);
    backward: every rank's gradient, gathered into the whole sequence."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        inv, ranks = _global_order(y.shape[1], cp, y.device)
        ctx.group, ctx.inv = group, inv
        return y[:, ranks[rank]]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        cp = dist.get_world_size(ctx.group)
        parts = [torch.empty_like(grad) for _ in range(cp)]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=1)[:, ctx.inv], None


def cp_local_params(
    params: dict[str, torch.Tensor], layout: DeltaNetLayout, sizes: dict[str, int], cp: int, rank: int
) -> dict[str, torch.Tensor]:
    """The views of a layer's tensors (``params``: FQN -> the tensor the forward would use, whole or a TP
    rank's) that CP rank ``rank`` of ``cp`` computes with: its heads' rows and columns (module docstring).
    ``sizes``: the layer's head and width attributes as they are now (whole, or a TP rank's)."""
    kd, vd = sizes["key_dim"], sizes["value_dim"]
    out = dict(params)
    for fqn in layout.fused:
        rows = torch.tensor(head_rows((kd, kd, vd), cp, rank), device=params[fqn].device)
        out[fqn] = params[fqn].index_select(0, rows)
    for fqn in layout.colwise:
        out[fqn] = params[fqn].chunk(cp, dim=0)[rank]
    for fqn in layout.rowwise:
        out[fqn] = params[fqn].chunk(cp, dim=1)[rank]
    return out


def _deltanet_cp_forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """Gather the sequence, run the layer's forward on this CP rank's heads, keep this rank's tokens."""
    group, inner = self._dhp_cp_group, self._dhp_cp_inner
    full = _GatherSequence.apply(hidden_states, group)
    self._dhp_cp_narrow = (dist.get_world_size(group), dist.get_rank(group))
    try:
        out = inner(full, *args, **kwargs)
    finally:
        self._dhp_cp_narrow = None
    return _SumToOwnTokens.apply(out, group)


def narrowed(
    module: nn.Module, params: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Inside a CP forward (:func:`apply_deltanet_cp`): ``params`` cut to this CP rank's heads and the
    sizes the forward must use; outside one: unchanged, no sizes. The TP style calls it on its local
    tensors (``module._dhp_narrow``)."""
    layout: DeltaNetLayout = module._dhp_cp_layout
    sizes = {a: getattr(module, a) for a in layout.sizes}
    narrow = getattr(module, "_dhp_cp_narrow", None)
    if narrow is None:
        return params, {}
    cp, rank = narrow
    return cp_local_params(params, layout, sizes, cp, rank), {a: v // cp for a, v in sizes.items()}


def _plain_forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """The layer without TP: transformers' forward on this CP rank's views of the whole parameters."""
    layout: DeltaNetLayout = self._dhp_cp_layout
    params = {f: self.get_parameter(f) for f in (*layout.fused, *layout.colwise, *layout.rowwise)}
    local, sizes = narrowed(self, params)
    return call_with(self, local, sizes, hidden_states, *args, **kwargs)


def call_with(module: nn.Module, tensors: dict[str, torch.Tensor], sizes: dict[str, int], *args, **kwargs):
    """transformers' own forward of ``module`` (``linear_attn_packed.deltanet_forward``: a packed
    micro-batch one sample at a time, on the gathered whole sequence) with ``tensors`` in place of its
    parameters and ``sizes`` as its head and width attributes, both restored after."""
    swapped, before = [], {a: getattr(module, a) for a in sizes}
    try:
        for fqn, t in tensors.items():
            owner_name, _, name = fqn.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            swapped.append((owner, name, owner._parameters[name]))
            owner._parameters[name] = t  # read by transformers' forward directly
        for a, v in sizes.items():
            setattr(module, a, v)
        return deltanet_forward(module, *args, **kwargs)
    finally:
        for owner, name, param in reversed(swapped):
            owner._parameters[name] = param
        for a, v in before.items():
            setattr(module, a, v)


def apply_deltanet_cp(
    layer: nn.Module, group: dist.ProcessGroup, *, module_name: str = "<module>"
) -> nn.Module:
    """Run one Gated DeltaNet layer under context parallelism over ``group`` (module docstring). Applied
    after TP (the layer's TP forward narrows its local heads further through :func:`narrowed`)."""
    layout = gated_deltanet_layout(layer)
    cp = dist.get_world_size(group)
    tp_sizes = {a: getattr(layer, a) for a in layout.sizes}
    check_divides(
        {
            "linear_num_key_heads (per TP rank)": tp_sizes["num_k_heads"],
            "linear_num_value_heads (per TP rank)": tp_sizes["num_v_heads"],
        },
        degree=cp,
        axis="cp",
        module=module_name,
    )
    layer._dhp_cp_layout = layout
    layer._dhp_cp_group = group
    layer._dhp_cp_narrow = None
    tp = tp_forward(layer)  # the TP style's bound forward, if TP was applied
    inner = tp if tp is not None else types.MethodType(_plain_forward, layer)
    layer._dhp_cp_inner = inner
    layer._dhp_narrow = functools.partial(narrowed, layer)
    layer.forward = types.MethodType(_deltanet_cp_forward, layer)
    return layer
