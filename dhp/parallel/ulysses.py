"""Ulysses sequence parallelism, applied from outside the model by hooks on the attention a family declares.

The family says where its attention is (``ModuleParallelPlan.sp``: :class:`~dhp.parallel.module_plan.AttentionSite`
= attention modules that attend over the whole sequence, their fused ``qkv`` Linear with output laid out
(3, H, d) or their separate q, k, v Linears, their ``out`` Linear, their head-count attribute). :func:`apply_ulysses_sp` installs, on each
such module over an SP group of N ranks (parameters stay replicated, FQNs unchanged):

- a forward pre-hook on the attention: takes the per-rank row counts (``ulysses_split_sizes`` kwarg, from
  the family's input shard) and gathers the rotary tables of all rows once per forward (they are a
  function of positions only); the attention's own forward then runs with ``L_total`` rows in view;
- hooks on ``qkv``: it computes on this rank's (L_r, D) rows, then an all-to-all turns q/k/v from
  sequence-sharded (L_r, H heads) into head-sharded (L_total, H/N heads); ``heads`` is set to H/N;
- a pre-hook on ``out``: the opposite all-to-all gives back (L_r, H*d) before the projection.

The attention kernel itself (transformers' own forward, any attention implementation) runs unchanged
on its head group over the whole sequence. Both all-to-alls have exact autograd (the backward is the
opposite one). A rank with no rows still runs the hooks (its all-to-alls send nothing), so collectives
match on every rank. Memory per rank: q/k/v of L_total rows x H/N heads, on average the bytes of the
local (L_r, H) q/k/v, plus the gathered rotary tables (L_total x head_dim, twice).

Each rank's output rows are its own tokens (the shard's ``token_index``). Parameter gradients are
partial sums over the rank's tokens: :func:`reduce_sp_grads` SUMs them over the SP group (losses are
pre-normalised by the global token count, see docs/INTERFACES.md). :func:`gather_sp_output`
all-gathers the rows in original order with a slicing backward, for parity and when wanted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

from dhp.errors import ConfigError, ConfigIssue, PlanError, RuntimeFailure
from dhp.parallel.dp import allreduce_grads_
from dhp.parallel.plan_match import match_sites

#: forward kwarg that carries the per-rank row counts to the attention hooks (set by the family's
#: input shard, ``forward_kwargs()``, and passed down by transformers' forwards as a keyword).
SPLIT_SIZES_KWARG = "ulysses_split_sizes"


@dataclass(frozen=True)
class UlyssesSpec:
    """How to apply Ulysses SP: the mesh axis to shard the sequence over.

    Collective bytes are counted by ``dhp.parallel.comm.CommCounter`` (it sees the all-to-alls)."""

    mesh_dim: str = "sp"


class _AllToAll(torch.autograd.Function):
    """Sequence-sharded <-> head-sharded all-to-all along dim 0/1; the backward is the opposite one."""

    @staticmethod
    def forward(ctx, x, split_sizes, group, to_heads: bool):  # type: ignore[override]
        ctx.split_sizes, ctx.group, ctx.to_heads = split_sizes, group, to_heads
        return _all_to_all(x, split_sizes, group, to_heads=to_heads)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        dx = _all_to_all(grad.contiguous(), ctx.split_sizes, ctx.group, to_heads=not ctx.to_heads)
        return dx, None, None, None


def _all_to_all(
    x: torch.Tensor, split_sizes: Sequence[int], group: dist.ProcessGroup, *, to_heads: bool
) -> torch.Tensor:
    """to_heads: (L_r, H, ...) -> (L_total, H/N, ...); else (L_total, H/N, ...) -> (L_r, H, ...).

    Uneven ``split_sizes`` (patches per rank, zeros allowed) go straight to ``all_to_all_single``.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = [int(s) for s in split_sizes]
    if to_heads:
        local, heads = x.shape[0], x.shape[1]
        send = x.reshape(local, world, heads // world, *x.shape[2:]).transpose(0, 1).contiguous()
        send = send.reshape(world * local, heads // world, *x.shape[2:])
        recv = x.new_empty((sum(sizes), heads // world, *x.shape[2:]))
        dist.all_to_all_single(recv, send, sizes, [local] * world, group=group)
        return recv
    local, heads_local = sizes[rank], x.shape[1]
    recv = x.new_empty((world * local, *x.shape[1:]))
    dist.all_to_all_single(recv, x.contiguous(), [local] * world, sizes, group=group)
    out = recv.reshape(world, local, heads_local, *x.shape[2:]).transpose(0, 1)
    return out.reshape(local, world * heads_local, *x.shape[2:])


def seq_to_head(x: torch.Tensor, split_sizes: Sequence[int], group: dist.ProcessGroup) -> torch.Tensor:
    """(L_r, H, ...) rows of this rank -> (L_total, H/N, ...) all rows of this rank's head group."""
    return _AllToAll.apply(x, tuple(split_sizes), group, True)


def head_to_seq(x: torch.Tensor, split_sizes: Sequence[int], group: dist.ProcessGroup) -> torch.Tensor:
    """(L_total, H/N, ...) of this rank's head group -> (L_r, H, ...) of this rank's rows."""
    return _AllToAll.apply(x, tuple(split_sizes), group, False)


def _sp_group(mesh: DeviceMesh, mesh_dim: str) -> dist.ProcessGroup:
    """The process group of the SP axis of ``mesh`` (a 1-D mesh may be unnamed)."""
    names = mesh.mesh_dim_names or ()
    if mesh_dim in names:
        return mesh.get_group(mesh_dim)
    if mesh.ndim == 1:
        return mesh.get_group()
    raise ConfigError(
        [
            ConfigIssue(
                "modules.<encoder>.parallel.sp",
                names,
                f"mesh has no '{mesh_dim}' axis",
                "build the mesh with an sp axis",
            )
        ]
    )


class _SiteState:
    """Per attention module: the SP group, head counts, and this call's row counts and local rows."""

    def __init__(self, group: dist.ProcessGroup, heads: int, site: Any) -> None:
        self.group, self.heads, self.site = group, heads, site
        self.split: tuple[int, ...] | None = None
        self.local: torch.Tensor | None = None


class _RotaryCache:
    """The gathered rotary tables of the last forward, keyed by the identity of the local ones (every
    attention of one forward gets the same (cos, sin) objects; AC recomputation reuses them).

    The gather runs outside selective AC's dispatch modes (:func:`_outside_selective_ac`). It
    runs in the first checkpointed block of a forward but, when the encoder has already run the next
    micro-batch's forward, again in a block's recompute; selective AC replays a block by counting
    each op's invocations, so ops that run in one pass and not the other must stay invisible to it.
    The tables are position data (detached, no autograd), so nothing is lost by hiding them.
    They are exchanged and kept in fp32, the dtype transformers computes them in: a rank without rows
    builds empty stand-ins in its activations' dtype (bf16 under a bf16 precision policy), and one
    exchange needs one dtype on every rank.
    """

    def __init__(self) -> None:
        self.key: tuple[torch.Tensor, torch.Tensor] | None = None
        self.value: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, pos: tuple[torch.Tensor, torch.Tensor], split, group) -> tuple[torch.Tensor, torch.Tensor]:
        if self.key is not None and self.key[0] is pos[0] and self.key[1] is pos[1]:
            return self.value
        self.key = pos
        cos, sin = pos
        with _outside_selective_ac():  # one collective for both tables
            both = _gather_rows(torch.cat([cos.detach(), sin.detach()], dim=-1).float(), split, group)
            self.value = (both[..., : cos.shape[-1]], both[..., cos.shape[-1] :])
        return self.value


@contextlib.contextmanager
def _outside_selective_ac() -> Iterator[None]:
    """The body runs under every active dispatch mode except selective AC's caching ones (collective
    counters and the memory accountant still see it; selective AC does not record it)."""
    with _disable_current_modes() as modes, contextlib.ExitStack() as stack:
        for mode in reversed(modes):  # bottom of the stack first
            if isinstance(mode, TorchDispatchMode) and not isinstance(
                mode, _CachingTorchDispatchMode | _CachedTorchDispatchMode
            ):
                stack.enter_context(mode)
        yield


def _gather_rows(x: torch.Tensor, split_sizes: Sequence[int], group: dist.ProcessGroup) -> torch.Tensor:
    """(L_r, ...) of every rank -> (L_total, ...) in rank order, uneven sizes (no autograd: position data)."""
    world = dist.get_world_size(group)
    out = x.new_empty((sum(split_sizes), *x.shape[1:]))
    send = torch.cat([x.contiguous()] * world) if world > 1 else x.contiguous()
    dist.all_to_all_single(out, send, list(split_sizes), [x.shape[0]] * world, group=group)
    return out


def _attention_pre_hook(state: _SiteState, cache: _RotaryCache):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        split = kwargs.pop(SPLIT_SIZES_KWARG, None)
        if split is None:
            raise RuntimeFailure(
                f"Ulysses SP attention {state.site.modules!r} was called without {SPLIT_SIZES_KWARG!r}. "
                "Fix: call the module with its family's input shard: module(**shard.forward_kwargs())."
            )
        state.split = tuple(int(s) for s in split)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        state.local = hidden
        # the attention's own forward sees L_total rows; the qkv pre-hook swaps the real rows back in
        stand_in = hidden.new_empty((sum(state.split), 0))
        if kwargs.get("position_embeddings") is not None:  # a forward kwarg of transformers' attention
            kwargs["position_embeddings"] = cache.get(kwargs["position_embeddings"], state.split, state.group)
        return (stand_in, *args[1:]), kwargs

    return hook


def _qkv_pre_hook(state: _SiteState):
    """The projection computes on this rank's rows (kept until the ``out`` pre-hook: with separate q, k,
    v Linears each of them reads them)."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        return (state.local, *args[1:])

    return hook


def _qkv_hook(state: _SiteState, *, chunks: int):
    """``chunks`` 3: a fused qkv output laid out (3, H, d); 1: one of separate q, k, v."""

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        rows, head_dim = out.shape[0], out.shape[1] // (chunks * state.heads)  # explicit: L_r may be 0
        qkv = out.reshape(rows, chunks, state.heads, head_dim).transpose(1, 2)  # (L_r, H, chunks, d)
        qkv = seq_to_head(qkv, state.split, state.group)  # (L_total, H/N, chunks, d)
        return qkv.transpose(1, 2).reshape(qkv.shape[0], -1)  # (L_total, chunks * H/N * d)

    return hook


def _out_pre_hook(state: _SiteState):
    def hook(module: nn.Module, args: tuple) -> tuple:
        x, state.local = args[0], None
        world = dist.get_world_size(state.group)
        head_dim = x.numel() // max(1, sum(state.split) * (state.heads // world))
        heads = x.reshape(sum(state.split), state.heads // world, head_dim)  # (L_total, H/N, d)
        local = head_to_seq(heads, state.split, state.group)  # (L_r, H, d)
        return (local.reshape(local.shape[0], state.heads * head_dim), *args[1:])

    return hook


def apply_ulysses_sp(module: nn.Module, mesh: DeviceMesh, spec: UlyssesSpec | None = None) -> nn.Module:
    """Make ``module`` sequence-parallel over ``mesh[spec.mesh_dim]`` at its family's attention sites, in place.

    Reads ``module.parallel_plan.sp`` (set by the family's ``build_module``). Parameters stay where they
    are (replicated) with unchanged FQNs; hooks are added (see the module docstring) and each site's
    head count becomes H/N. Feed the module its family's input shards (``shard.forward_kwargs()``).
    Raises ConfigError when the SP degree does not divide a size in ``plan.sp_divides``, PlanError when
    the module declares no attention site.
    """
    spec = spec or UlyssesSpec()
    plan = module_plan(module)
    group = _sp_group(mesh, spec.mesh_dim)
    sp = dist.get_world_size(group)
    issues = [
        ConfigIssue(f"modules.<module>.parallel.{spec.mesh_dim}", sp, f"must divide the {what}={size}",
                    f"pick {spec.mesh_dim} among the divisors of {size}")
        for what, size in plan.sp_divides.items() if size % sp
    ]  # fmt: skip
    if issues:
        raise ConfigError(issues)
    if not plan.sp and plan.sp_local:
        return module  # the family's input cut keeps every attention on its rank: nothing to install
    if not plan.sp:
        raise PlanError(
            f"{type(module).__name__} declares no attention site for sequence parallelism. "
            "Fix: use tp or fsdp/dp for this module."
        )
    if sp == 1:
        return module
    cache = _RotaryCache()
    for site, attn in match_sites(module, plan.sp):
        heads = getattr(attn, site.heads)
        state = _SiteState(group, heads, site)
        setattr(attn, site.heads, heads // sp)
        attn.register_forward_pre_hook(_attention_pre_hook(state, cache), with_kwargs=True)
        names = site.projections or (site.qkv,)
        for name in names:  # a fused qkv, or separate q, k, v: one all-to-all each
            proj = attn.get_submodule(name)
            proj.register_forward_pre_hook(_qkv_pre_hook(state))
            proj.register_forward_hook(_qkv_hook(state, chunks=3 if len(names) == 1 else 1))
        attn.get_submodule(site.out).register_forward_pre_hook(_out_pre_hook(state))
    return module


def module_plan(module: nn.Module):
    """The :class:`~dhp.parallel.module_plan.ModuleParallelPlan` a family attached to ``module`` at build."""
    plan = getattr(module, "parallel_plan", None)
    if plan is None:
        raise PlanError(
            f"{type(module).__name__} has no parallel_plan; dhp.parallel applies strategies to modules "
            "built by a model family (family.build_module attaches family.parallel_plan(name, hf_config))."
        )
    return plan


def reduce_sp_grads(module: nn.Module, sp_group: dist.ProcessGroup) -> None:
    """SUM every trainable parameter's gradient over the SP group, in place (one all-reduce per dtype).

    Each SP rank holds the partial gradient of its own tokens; a missing grad (a rank with no tokens)
    counts as zeros. Plain tensors (the module replicated on each SP rank) are summed whole; FSDP2's
    DTensor grads are summed shard by shard: the ranks of one SP group sit at the same fsdp coordinate,
    so they hold the same shard index, already reduce-scattered over fsdp in backward.
    """
    allreduce_grads_([p for p in module.parameters() if p.requires_grad], sp_group)


class _GatherRows(torch.autograd.Function):
    """All-gather each rank's rows into original token order; backward slices this rank's rows."""

    @staticmethod
    def forward(ctx, local, token_index, num_tokens, group):  # type: ignore[override]
        ctx.token_index = token_index
        world = dist.get_world_size(group)
        counts = torch.tensor([local.shape[0]], dtype=torch.long, device=local.device)
        all_counts = [torch.zeros_like(counts) for _ in range(world)]
        dist.all_gather(all_counts, counts, group=group)
        most = int(max(int(c) for c in all_counts))
        padded = local.new_zeros((most, *local.shape[1:]))
        padded[: local.shape[0]] = local
        index = torch.full((most,), -1, dtype=torch.long, device=local.device)
        index[: local.shape[0]] = token_index.to(local.device)
        rows = [torch.empty_like(padded) for _ in range(world)]
        indices = [torch.empty_like(index) for _ in range(world)]
        dist.all_gather(rows, padded, group=group)
        dist.all_gather(indices, index, group=group)
        rows_cat, index_cat = torch.cat(rows), torch.cat(indices)
        keep = index_cat >= 0
        full = local.new_empty((num_tokens, *local.shape[1:]))
        full[index_cat[keep]] = rows_cat[keep]
        return full

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad[ctx.token_index.to(grad.device)], None, None, None


def gather_sp_output(local: torch.Tensor, shard: Any, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(rows of this rank) -> (num_tokens, D) in original token order on every SP rank (collective).

    Autograd: the output is replicated, so the backward of each rank keeps only its own rows' gradient
    (a slice, no reduction); param grads then need :func:`reduce_sp_grads` as usual.
    """
    if shard.sp_size == 1 or group is None:
        return local
    return _GatherRows.apply(local, shard.token_index, shard.num_tokens, group)
