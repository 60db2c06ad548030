"""The one token cross-entropy of dhp: chunked over tokens, optionally vocab-parallel over a TP group.

``shifted_ce_sum(hidden, weight, labels)`` is the fp32 SUM of next-token cross-entropies
(``hidden[:, t]`` predicts ``labels[:, t + 1]``; ``IGNORE_INDEX`` labels count for nothing), computed
from the last hidden states and the lm_head weight, never from materialised logits:

- only the label tokens are kept (image and padding tokens carry ``IGNORE_INDEX`` and cost nothing);
- they are processed ``chunk_tokens`` at a time: per chunk, fp32 logits ``(chunk, V_local)`` on this
  rank's vocab shard, the vocab-wide max, sum-exp and target logit (three numbers per token, reduced
  over ``group`` when the vocab is sharded), then the chunk's logits are dropped;
- backward recomputes each chunk's logits from the saved hidden rows and the per-token log-sum-exp
  (softmax and its gradient in place), so the peak is about one chunk's fp32 logits,
  ``chunk * V_local * 4`` bytes, whatever the sequence length, plus the weight gradient accumulated in
  fp32 (``V_local * H * 4``, cast to the weight's dtype once). Unchunked, fp32 logits, their
  log-softmax and their gradient cost about ``3 * tokens * V_local * 4``.

Vocab-parallel: ``weight`` is this rank's ``(V / tp, H)`` row block starting at ``vocab_start``; the loss
is the full sum on every rank. The gradient w.r.t. ``hidden`` is a partial sum per rank (each rank sees
only its vocab rows); with ``reduce_input_grad=True`` it is summed over ``group`` here, so the input
gradient (to the image embeddings, eventually) is complete. A caller that reduces it itself (a
reduce-scatter into sequence shards) passes ``False`` and marks the input as a partial sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100
#: tokens per chunk when the config leaves ``loss_chunk_tokens`` at 0: at a 152K vocab, sharded 8
#: ways, one chunk's fp32 logits + gradient are 2 * 4096 * 19K * 4 B = 0.6 GB; at TP=1 it is 5 GB.
DEFAULT_LOSS_CHUNK_TOKENS = 4096


def resolve_chunk_tokens(chunk_tokens: int) -> int:
    """``chunk_tokens`` when positive, else :data:`DEFAULT_LOSS_CHUNK_TOKENS`."""
    if chunk_tokens < 0:
        raise ValueError(f"loss chunk size must be >= 0 tokens (0 = default), got {chunk_tokens}")
    return chunk_tokens if chunk_tokens > 0 else DEFAULT_LOSS_CHUNK_TOKENS


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits of one chunk: the matmul runs in the weights' dtype (as ``nn.Linear``), then fp32."""
    return F.linear(h, weight, bias).float()


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)


class _ChunkedCE(torch.autograd.Function):
    """SUM of CEs of ``h`` (n, H) rows against ``targets`` (n,), every target valid; see module doc."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        h: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        vocab_start: int,
        group: dist.ProcessGroup | None,
        reduce_input_grad: bool,
    ) -> torch.Tensor:
        n, rows = h.shape[0], weight.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, n, chunk):
            logits = _logits(h[s : s + chunk], weight, bias)
            m = logits.amax(dim=-1)
            _all_reduce(m, dist.ReduceOp.MAX, group)
            local = targets[s : s + chunk] - vocab_start
            inside = (local >= 0) & (local < rows)
            picked = logits.gather(1, local.clamp(0, rows - 1).unsqueeze(1)).squeeze(1)
            sum_exp = logits.sub_(m.unsqueeze(1)).exp_().sum(-1)  # in place: one chunk buffer only
            stats = torch.stack([sum_exp, picked.masked_fill(~inside, 0.0)])
            del logits
            _all_reduce(stats, dist.ReduceOp.SUM, group)
            lse[s : s + chunk] = m + stats[0].log()
            total += (lse[s : s + chunk] - stats[1]).sum()
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.chunk, ctx.vocab_start, ctx.group, ctx.reduce = chunk, vocab_start, group, reduce_input_grad
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        h, weight, bias, targets, lse = ctx.saved_tensors
        rows, chunk = weight.shape[0], ctx.chunk
        gh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        gb = torch.zeros(rows, dtype=torch.float32, device=h.device) if bias is not None else None
        for s in range(0, h.shape[0], chunk):
            hc = h[s : s + chunk]
            d = _logits(hc, weight, bias).sub_(lse[s : s + chunk].unsqueeze(1)).exp_()  # softmax, in place
            local = targets[s : s + chunk] - ctx.vocab_start
            inside = ((local >= 0) & (local < rows)).nonzero().squeeze(1)
            d[inside, local[inside]] -= 1.0
            d.mul_(grad)
            dc = d.to(h.dtype)
            if gh is not None:
                gh[s : s + chunk] = dc @ weight
            if gw is not None:
                gw.addmm_(d.t(), hc.float())
            if gb is not None:
                gb += d.sum(0)
            del d, dc
        if gh is not None and ctx.reduce:
            _all_reduce(gh, dist.ReduceOp.SUM, ctx.group)
        gw = gw.to(weight.dtype) if gw is not None else None
        gb = gb.to(bias.dtype) if gb is not None else None
        return gh, gw, gb, None, None, None, None, None


def chunked_ce_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int = 0,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    reduce_input_grad: bool = True,
) -> torch.Tensor:
    """fp32 SUM of CEs of ``hidden`` (..., H) against ALIGNED ``targets`` (...) (no shift here).

    ``weight`` (V_local, H) plain tensor, ``bias`` (V_local,) or None; ``IGNORE_INDEX`` targets are
    dropped before any matmul. ``group`` None: one process, the whole vocab. Peak extra memory: one
    chunk of fp32 logits (and its gradient in backward) on this rank's vocab shard.
    """
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1).to(flat_h.device)
    keep = (flat_t != IGNORE_INDEX).nonzero().squeeze(1)
    return _ChunkedCE.apply(
        flat_h.index_select(0, keep),
        weight,
        bias,
        flat_t.index_select(0, keep),
        resolve_chunk_tokens(chunk_tokens),
        vocab_start,
        group,
        reduce_input_grad,
    )


def shifted_ce_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int = 0,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    reduce_input_grad: bool = True,
    shift: bool = True,
) -> torch.Tensor:
    """fp32 SUM of next-token CEs: ``hidden`` (B, S, H), ``labels`` (B, S) UNSHIFTED (HF convention).

    Equals transformers' ``ForCausalLMLoss`` with ``reduction="sum"`` (within fp32 summation order);
    see :func:`chunked_ce_sum` for the other arguments. ``shift=False``: ``labels`` are already each
    token's next-token target (context parallelism shifts on the whole sequence, then cuts).
    """
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX) if shift else labels
    return chunked_ce_sum(
        hidden,
        weight,
        shifted,
        bias=bias,
        chunk_tokens=chunk_tokens,
        group=group,
        vocab_start=vocab_start,
        reduce_input_grad=reduce_input_grad,
    )
