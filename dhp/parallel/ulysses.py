"""Ulysses sequence parallelism for the Qwen2.5-VL vision encoder, applied from outside transformers.

Placement after :func:`apply_ulysses_sp` on an SP group of N ranks (parameters stay replicated):
- each rank holds the patch rows of a contiguous, window-aligned slice of the window order
  (:func:`dhp.parallel.sp_shard.shard_vision_batch`), so activations are ~1/N per rank;
- window-attention blocks, MLPs, norms, the patch embedding and the merger run locally, no communication;
- the attention of each full-attention block is swapped for :func:`ulysses_attention_forward`:
  q/k/v are computed and rotated locally, an all-to-all turns them from sequence-sharded (L_r, H heads)
  into head-sharded (L_total, H/N heads), attention runs per image over the whole sequence, and a second
  all-to-all turns the output back (both with exact autograd: the backward is the opposite all-to-all);
- a rank with no tokens (fewer windows than ranks) still runs the full-attention blocks' all-to-alls
  and the attention of its head group, so collectives match on every rank.

Each rank's merged output rows are its own tokens (``shard.token_index``). Parameter gradients are
partial sums over the rank's tokens: :func:`reduce_sp_grads` SUMs them over the SP group (losses are
pre-normalised by the global token count, see docs/INTERFACES.md). :func:`gather_vision_output`
all-gathers the rows in original order with a slicing backward, for parity and when wanted.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    ALL_ATTENTION_FUNCTIONS,
    Qwen2_5_VisionTransformerPretrainedModel,
    apply_rotary_pos_emb_vision,
    eager_attention_forward,
    get_max_seqlen,
    is_flash_attention_requested,
)

from dhp.errors import ConfigError, ConfigIssue, PlanError, RuntimeFailure
from dhp.parallel.sp_shard import SPLIT_SIZES_KWARG, VisionShard


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


def _attend(
    attn: nn.Module, q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int | None, kwargs: dict
) -> torch.Tensor:
    """Attention of (1, h, L, d) q/k/v per cu_seqlens segment, as transformers' vision attention does it."""
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        attn.config._attn_implementation, eager_attention_forward
    )
    dropout = 0.0 if not attn.training else attn.attention_dropout
    if is_flash_attention_requested(attn.config):
        max_seqlen = get_max_seqlen(cu_seqlens, attn.config, kwargs={"max_seqlen": max_seqlen})
        out, _ = interface(
            attn, q, k, v, attention_mask=None, scaling=attn.scaling, dropout=dropout,
            cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen,
            max_length_k=max_seqlen, is_causal=False, **kwargs,
        )  # fmt: skip
        return out[0]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    chunks = zip(*(torch.split(t, lengths, dim=2) for t in (q, k, v)), strict=True)
    outs = [
        interface(
            attn,
            qc,
            kc,
            vc,
            attention_mask=None,
            scaling=attn.scaling,
            dropout=dropout,
            is_causal=False,
            **kwargs,
        )[0]
        for qc, kc, vc in chunks
    ]
    return torch.cat(outs, dim=1)[0]


def ulysses_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_seqlen: int | None = None,
    **kwargs,
) -> torch.Tensor:
    """Full-attention forward of a ``Qwen2_5_VLVisionAttention`` under Ulysses SP (bound as its forward).

    ``hidden_states`` are this rank's (L_r, D) rows; ``cu_seqlens`` are the *global* image segments.
    Memory: q/k/v for L_total rows of H/N heads, the same bytes as the local (L_r, H) q/k/v on average.
    """
    split_sizes = kwargs.pop(SPLIT_SIZES_KWARG, None)
    if split_sizes is None:
        raise RuntimeFailure(
            "the Ulysses-SP vision encoder was called without 'ulysses_split_sizes'. Fix: call it with "
            "VisionShard.forward_kwargs() from dhp.parallel.sp_shard.shard_vision_batch(..., sp_size=N>1)."
        )
    group = self._dhp_sp_group
    length, heads = hidden_states.shape[0], self.num_heads
    qkv = self.qkv(hidden_states).reshape(length, 3, heads, self.head_dim)
    q, k, v = qkv.unbind(1)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    qkv = seq_to_head(torch.stack((q, k, v), dim=2), split_sizes, group)  # (L_total, H/N, 3, d)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in qkv.unbind(2))
    out = _attend(self, q, k, v, cu_seqlens, max_seqlen, kwargs)  # (L_total, H/N, d)
    out = head_to_seq(out, split_sizes, group)  # (L_r, H, d)
    return self.proj(out.reshape(length, heads * self.head_dim))


def sp_vision_forward(self: nn.Module, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs):
    """Forward of the SP-applied transformers vision model (bound as its forward).

    A rank with patches runs transformers' own forward with the shard's precomputed metadata. A rank with
    no patches runs only what takes part in collectives: each full-attention block on zero rows (its
    attention still computes this rank's head group over all tokens), then the merger: (0, out_dim).
    """
    if hidden_states.shape[0] > 0:
        return type(self).forward(self, hidden_states, grid_thw, **kwargs)
    hidden = self.patch_embed(hidden_states)
    empty = hidden.new_zeros(0, self.config.hidden_size // self.config.num_heads)
    for index in sorted(self.fullatt_block_indexes):
        hidden = self.blocks[index](
            hidden,
            cu_seqlens=kwargs["cu_seqlens"],
            max_seqlen=kwargs.get("max_seqlen"),
            position_embeddings=(empty, empty),
            **{SPLIT_SIZES_KWARG: kwargs[SPLIT_SIZES_KWARG]},
        )
    return BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=self.merger(hidden))


def find_vision_model(module: nn.Module) -> Qwen2_5_VisionTransformerPretrainedModel:
    """The transformers vision model inside ``module`` (``module.visual`` for dhp's VisionModule)."""
    found = [m for m in module.modules() if isinstance(m, Qwen2_5_VisionTransformerPretrainedModel)]
    if len(found) != 1:
        raise ConfigError(
            [
                ConfigIssue(
                    "modules.vision", type(module).__name__, f"expected one Qwen2.5-VL vision model, found {len(found)}",
                    "apply vision parallelism to the vision module only",
                )
            ]
        )  # fmt: skip
    return found[0]


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
                "modules.vision.parallel.sp",
                names,
                f"mesh has no '{mesh_dim}' axis",
                "build the mesh with an sp axis",
            )
        ]
    )


def apply_ulysses_sp(module: nn.Module, mesh: DeviceMesh, spec: UlyssesSpec) -> nn.Module:
    """Make ``module``'s vision encoder sequence-parallel over ``mesh[spec.mesh_dim]``, in place.

    Parameters stay where they are (replicated) with unchanged FQNs. Swaps the forward of the vision
    model and of its full-attention blocks' attention; feed it ``VisionShard.forward_kwargs()``. Raises
    ConfigError when the SP degree does not divide the encoder heads.
    """
    group = _sp_group(mesh, spec.mesh_dim)
    sp = dist.get_world_size(group)
    visual = find_vision_model(module)
    heads = visual.config.num_heads
    if heads % sp:
        raise ConfigError(
            [
                ConfigIssue(
                    "modules.vision.parallel.sp", sp, f"must divide the vision encoder's num_heads={heads}",
                    f"pick sp among the divisors of {heads}",
                )
            ]
        )  # fmt: skip
    if sp == 1:
        return module
    visual.forward = types.MethodType(sp_vision_forward, visual)
    for index in visual.fullatt_block_indexes:
        attn = visual.blocks[index].attn
        attn._dhp_sp_group = group
        attn.forward = types.MethodType(ulysses_attention_forward, attn)
    return module


def reduce_sp_grads(module: nn.Module, sp_group: dist.ProcessGroup) -> None:
    """SUM every trainable parameter's gradient over the SP group, in place (one all-reduce per dtype).

    Each SP rank holds the partial gradient of its own tokens; a missing grad (a rank with no tokens)
    counts as zeros. Needs the full module replicated on each SP rank (plain tensors, not DTensors).
    """
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=sp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


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


def gather_vision_output(
    local: torch.Tensor, shard: VisionShard, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """(rows of this rank) -> (num_tokens, D) in original token order on every SP rank (collective).

    Autograd: the output is replicated, so the backward of each rank keeps only its own rows' gradient
    (a slice, no reduction); param grads then need :func:`reduce_sp_grads` as usual.
    """
    if shard.sp_size == 1 or group is None:
        return local
    return _GatherRows.apply(local, shard.token_index, shard.num_tokens, group)


def vision_shard_forward(module: nn.Module, shard: VisionShard) -> torch.Tensor:
    """This rank's merged embeddings for ``shard``: rows aligned with ``shard.token_index``.

    ``sp_size == 1``: ``module(**shard.forward_kwargs())``, through the vision module's own forward (and
    so through any FSDP root hooks). ``sp_size > 1``: the transformers vision model inside ``module`` is
    called directly with the shard's rows and metadata, because ``VisionModule.forward`` checks
    ``rows == sum(t*h*w)`` of the whole batch (see docs/INTERFACES.md, Parallel); FSDP on the vision
    module together with SP is therefore refused here with a PlanError.
    """
    if shard.sp_size == 1:
        return module(**shard.forward_kwargs())
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        raise PlanError(
            "the vision module has both Ulysses SP and FSDP; SP shards bypass the module's FSDP root. "
            "Fix: use modules.vision.parallel {sp, dp, zero} (ZeRO-1 across dp), not fsdp, with sp > 1."
        )
    visual = find_vision_model(module)
    kwargs = shard.forward_kwargs()
    pixel_values = kwargs.pop("pixel_values").to(visual.patch_embed.proj.weight.dtype)
    return visual(pixel_values, grid_thw=kwargs.pop("image_grid_thw"), **kwargs).pooler_output
