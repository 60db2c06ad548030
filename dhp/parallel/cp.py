"""Context parallelism (CP) for a decoder: each of the ``cp`` ranks of a context group holds its own
tokens of the micro-batch, and full attention sees every token through an all-gather of K and V.

What it does to placements
--------------------------
The sequence of ``S`` tokens (after the family has computed every position, M-RoPE included, on the
whole sequence) is cut into ``2 * cp`` contiguous chunks of ``ceil`` or ``floor`` of ``S / (2 cp)``
tokens; CP rank ``r`` keeps chunks ``r`` and ``2 cp - 1 - r`` (:func:`rank_index`), so every rank does
the same causal-attention work (Megatron's and torchtitan's load balance). Everything per token (the
embeddings, norms, MLPs, MoE experts, the LM head and the loss) runs on the rank's own ``~S / cp``
tokens only: activations are 1/cp of the unsplit module's. Parameters stay whole (replicated over
cp, like over dp): their gradients are SUMMED over the cp ranks (``dhp.parallel.optim.finalize_grads``).

Full attention (:func:`cp_attention`, registered with transformers as the attention implementation
``dhp_cp``): the rank's keys and values are all-gathered over the context group (padded to the longest
rank's count: gloo needs equal sizes), and the rank's queries attend over all of them with the exact
mask of the whole sequence: causal by global position and never across packed samples (the row's
sample ids in ``attention_mask``). The gather's backward sums the gradient of every rank's keys and
values back to their owner. Transient per rank and layer: the gathered K and V, ``2 * S * kv_heads *
head_dim`` elements, and the mask, ``S / cp * S`` booleans per row; the attention keeps only the
rank's own q, k, v for backward, which gathers again and recomputes the attention (one more attention
forward per layer: the saved activations are 1/cp of the unsplit module's). Exact: every query sees exactly
the keys it sees unsplit, so the result equals the unsplit attention up to float summation order.
(All-gather rather than a ring: it is exact for any mask, including packing, costs one collective a
layer, and for grouped-query attention the K/V are a small part of the hidden state. torch's
``context_parallel`` rings only over SDPA with ``is_causal`` and no mask, so it cannot pack.)

The loss: the labels are shifted on the whole sequence, then cut like the tokens, so each rank's
next-token targets are its own tokens' (:func:`aligned_labels`); the runtime normalises by the step's
global label-token count, as without CP.

Nothing here names a model family: a family that declares ``cp`` for a module computes its positions
on the whole sequence, cuts its inputs with the module's :class:`ContextShard` (``module.context_shard``)
and passes :meth:`ContextShard.masks` as the text model's ``attention_mask`` mapping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from dhp.errors import PlanError
from dhp.ops.context import rank_index
from dhp.parallel.llm_tp import pad_to_multiple

#: the attention implementation name registered with transformers
CP_ATTENTION = "dhp_cp"
#: the attribute that gives every submodule of a CP text model its ContextShard
SHARD_ATTR = "_dhp_context_shard"
IGNORE_INDEX = -100  # dhp.ops.cross_entropy's


@dataclass(frozen=True)
class ContextMask:
    """What :func:`cp_attention` needs to mask one micro-batch exactly: the row's sample ids of every
    global token (``segments`` (B, S): 0 padding, k >= 1 the k-th sample, as ``dhp.ops.packed``), the
    global index of each of this rank's tokens and of each rank's (gather order)."""

    segments: torch.Tensor  # (B, S) long, the whole micro-batch's attention_mask
    own: torch.Tensor  # (L,) global indices of this rank's tokens, local order
    ranks: tuple[torch.Tensor, ...]  # per CP rank, its global indices (the all-gather's order)
    shard: ContextShard

    def allowed(self) -> torch.Tensor:
        """(B, 1, L, cp * Lmax) bool: query i may attend key j (causal by global position, same sample
        or padding run); the gather's padding keys never."""
        width = max(len(r) for r in self.ranks)
        keys = torch.full((len(self.ranks), width), -1, dtype=torch.long, device=self.own.device)
        for r, idx in enumerate(self.ranks):
            keys[r, : len(idx)] = idx
        keys = keys.reshape(-1)
        valid = keys >= 0
        k = keys.clamp(min=0)
        causal = (k[None, :] <= self.own[:, None]) & valid[None, :]  # (L, K)
        seg_q = self.segments[:, self.own]  # (B, L)
        seg_k = self.segments[:, k]  # (B, K)
        same = seg_q[:, :, None] == seg_k[:, None, :]
        return (same & causal[None]).unsqueeze(1)


class ContextShard:
    """The context group of one module and this rank's place in it: cuts a micro-batch's per-token
    tensors to this rank's tokens (:meth:`take`) and builds the masks its attention needs."""

    def __init__(self, group: dist.ProcessGroup, *, inner: str) -> None:
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.inner = inner  # the attention kernel the gathered keys are attended with (sdpa, ...)

    def index(self, seq_len: int, device: torch.device | str) -> torch.Tensor:
        return rank_index(seq_len, self.cp, self.rank, device)

    def take(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """``x`` cut along its sequence dim ``dim`` to this rank's tokens (local order)."""
        return x.index_select(dim, self.index(x.shape[dim], x.device))

    def mask(self, attention_mask: torch.Tensor) -> ContextMask:
        """The :class:`ContextMask` of a micro-batch whose (B, S) ``attention_mask`` (sample ids) this is."""
        seq, dev = attention_mask.shape[1], attention_mask.device
        ranks = tuple(rank_index(seq, self.cp, r, dev) for r in range(self.cp))
        return ContextMask(segments=attention_mask.long(), own=ranks[self.rank], ranks=ranks, shard=self)

    def text_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """The text model's ``attention_mask``: the (B, 1, L, cp * Lmax) boolean mask of this rank's
        queries over the gathered keys (:meth:`ContextMask.allowed`). transformers takes a 4-D mask as
        given, and :func:`cp_attention` applies it to the keys it gathers."""
        return self.mask(attention_mask).allowed()

    def aligned_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """This rank's next-token targets: ``labels`` shifted on the whole sequence, then cut."""
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        return self.take(shifted, dim=1)


class _GatherTokens(torch.autograd.Function):
    """All-gather (B, H, L_r, D) along the tokens of a context group, padded to the longest rank; the
    backward sums every rank's gradient of the gathered tensor and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, width: int, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.length, ctx.width = group, x.shape[2], width
        pad = torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[2])).contiguous()
        out = [torch.empty_like(pad) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, pad, group=group)
        return torch.cat(out, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return grad[:, :, r * ctx.width : r * ctx.width + ctx.length], None, None


def gather_tokens(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """This rank's (B, H, L, D) keys or values -> every rank's, in :meth:`ContextMask.allowed`'s order
    (every rank holds the same number of tokens: the module pads each micro-batch to a multiple of 2 cp)."""
    return _GatherTokens.apply(x, x.shape[2], shard.group)


def cp_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface under CP: local queries over the gathered keys and values
    with ``attention_mask`` (:meth:`ContextShard.text_mask`); returns (B, L, H, D) as transformers' own
    kernels do. The context group is the attention module's ``_dhp_context_shard`` (:func:`apply_cp`)."""
    shard = getattr(module, SHARD_ATTR, None)
    want = (query.shape[0], 1, query.shape[2], key.shape[2] * (shard.cp if shard else 0))
    if shard is None or attention_mask is None or tuple(attention_mask.shape) != want:
        raise PlanError(
            "context parallelism: the attention got no context mask of this rank's queries over every "
            f"rank's keys (shape {want}); the family's forward must pass module.text_mask(attention_mask) "
            "as the text model's attention_mask."
        )
    # transformers loads with the first CP module, not with dhp.parallel (the driver imports it)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if shard.inner not in ("sdpa", "eager"):
        raise PlanError(
            f"context parallelism runs its attention with sdpa; attn_implementation="
            f"{shard.inner!r} under cp > 1 is not built yet. Fix: model.attn_implementation=sdpa."
        )

    def attend(q: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor) -> torch.Tensor:
        k, v = gather_tokens(k_local, shard), gather_tokens(v_local, shard)
        out, _ = sdpa_attention_forward(
            module, q, k, v, attention_mask, dropout=dropout, scaling=scaling, is_causal=False
        )
        return out

    # keep only this rank's q, k, v for backward: the gathered keys and values (cp x larger) are
    # gathered again there, with the attention recomputed (one more attention forward per layer)
    return checkpoint(attend, query, key, value, use_reentrant=False), None


def register_cp_attention() -> None:
    """Register :func:`cp_attention` with transformers (idempotent)."""
    from transformers import AttentionInterface  # loaded with the first CP module, as above

    AttentionInterface.register(CP_ATTENTION, cp_attention)


def apply_cp(module: nn.Module, group: dist.ProcessGroup, *, multiple: int, pad_id: int) -> nn.Module:
    """Give ``module`` (a family LLM module declaring ``cp``) its :class:`ContextShard` over ``group`` and
    route its text model's attention through :func:`cp_attention`. The kernel the family configured
    (``config._attn_implementation``) is kept as the shard's inner kernel.

    A forward pre-hook right-pads each micro-batch's token inputs to a multiple of ``multiple``
    (``2 * cp``, times tp under sequence parallelism inside TP, so every chunk splits evenly there too):
    padding has attention mask 0 and ignored labels, and sits after every real token, so no real
    token attends to it or is counted by the loss."""
    register_cp_attention()
    config = module.language_model.config
    shard = ContextShard(group, inner=config._attn_implementation)
    module.context_shard = shard
    for sub in module.language_model.modules():  # the attention modules find their group here
        setattr(sub, SHARD_ATTR, shard)
    config._attn_implementation = CP_ATTENTION
    module.register_forward_pre_hook(
        lambda _m, args, kwargs: (args, pad_to_multiple(kwargs, multiple=multiple, pad_id=pad_id)),
        with_kwargs=True,
    )
    return module
