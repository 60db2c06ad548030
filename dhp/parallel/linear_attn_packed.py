"""Packed rows through a Gated DeltaNet (linear attention) layer: every sample on its own, as unpacked.

The gated delta rule is a recurrence along the row and its causal conv1d looks back ``kernel - 1``
tokens, so transformers' layer run on a packed row carries both from one sample into the next.
transformers' torch fallback of the two ops (every CPU run; a GPU without the kernel packages) cannot
keep packed samples apart: called on the row it mixes them silently, and called with the varlen
arguments (``cu_seqlens`` of the delta rule, ``seq_idx`` of the conv) it raises ValueError
(transformers 5.25, ``integrations.hub_kernels``).

:func:`deltanet_forward` is the one call of transformers' forward of a Gated DeltaNet layer in dhp: the
plain layer (:func:`split_packed_rows` makes it the layer's forward), the TP style
(``dhp.parallel.linear_attn_tp``, on its local heads) and context parallelism
(``dhp.parallel.linear_attn_cp.call_with``, on the gathered whole sequence) all run the layer through
it. Its ``attention_mask`` is what the text model hands its linear-attention layers: transformers' 2-D
padding mask (0/1, passed on unchanged), or, for a packed micro-batch, the row's sample ids (0 padding,
k >= 1 the k-th sample: ``dhp.models.packing`` puts them in the text model's per-layer-type mask). The
ids reach the layer as an argument of its decoder layer, so activation checkpointing's recompute,
which calls the decoder layer again with the same arguments, splits the same way. With sample ids, by
the kernel ``dhp.ops.linear_attn`` names for the input's device:

- ``torch-fallback``: transformers' forward on every sample alone: each sample in a row of its own
  from its first token, so a fresh recurrent state and a conv that starts at the sample, exactly what
  the sample sees unpacked (its right padding, masked 0, comes after its tokens and is causally
  invisible). The samples that span the same number of the rule's 64-token chunks share one call
  (right-padded to the longest of them, which the rule's own chunk padding mostly covers), so a layer
  makes one call per distinct chunk count, not per sample. The outputs are scattered back into the
  rows; padding runs get a zero output (no sample attends them, no label reads them). Memory: one
  group's input copy and activations at a time in the forward; autograd keeps every group's, about
  as many tokens as the micro-batch's samples (rounded up to whole chunks).
- ``fla-chunk`` (CUDA with flash-linear-attention and causal-conv1d): one call on the micro-batch
  flattened to one row ``(1, B*S)``, with ``cu_seq_lens_q`` (transformers hands it to the delta rule as
  ``cu_seqlens``) and ``seq_idx`` (to the conv) marking every sample and padding run: both kernels
  restart their state at each boundary.
- ``fla-chunk+torch-conv1d``: PlanError; transformers would run the torch conv on the flattened row,
  which cannot keep the samples apart.

The flash-attention varlen kwargs that a packed micro-batch passes to the text model
(``cu_seq_lens_q/k``, ``max_length_q/k``, for its full-attention layers) reach these layers too; they
describe the full attention's layout, so they are dropped here.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from dhp.errors import PlanError
from dhp.ops.linear_attn import FLA_CHUNK, TORCH_FALLBACK, linear_attention_kernel
from dhp.ops.packed import is_packed, segments

#: the full-attention varlen kwargs of a packed micro-batch (``dhp.models.packing.varlen_kwargs``)
FLASH_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_ARGS = ("hidden_states", "cache", "attention_mask")  # transformers' GatedDeltaNet.forward, in order
#: the torch chunked rule's chunk (transformers' ``chunk_size`` default): it only groups the samples
#: into calls (the result does not depend on it)
DELTA_RULE_CHUNK = 64


def deltanet_forward(module: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    """transformers' own forward of the Gated DeltaNet ``module`` (``type(module).forward``), with a packed
    ``attention_mask`` (sample ids) kept apart per sample (module docstring). Arguments as transformers'
    forward takes them; the module's parameters and sizes are whatever the caller set (TP's local heads,
    CP's narrowed ones)."""
    if len(args) > len(_ARGS):
        raise TypeError(f"{type(module).__name__}.forward takes at most {len(_ARGS)} positional arguments")
    call = dict(zip(_ARGS, args, strict=False))
    for name in _ARGS:
        if name in kwargs:
            call[name] = kwargs.pop(name)
    for name in FLASH_VARLEN_KWARGS:
        kwargs.pop(name, None)
    hidden, cache, mask = call["hidden_states"], call.get("cache"), call.get("attention_mask")
    forward = type(module).forward
    if mask is None or not is_packed(mask):
        return forward(module, hidden, cache=cache, attention_mask=mask, **kwargs)
    if cache is not None:
        raise PlanError(
            f"{type(module).__name__}: a packed micro-batch (sample ids in attention_mask) came with a "
            "cache; packed rows are for training only. Fix: call the model with use_cache=False."
        )
    kernel = linear_attention_kernel(hidden.device.type)
    if kernel == TORCH_FALLBACK:
        return _per_sample(module, forward, hidden, mask, kwargs)
    if kernel == FLA_CHUNK:
        return _varlen(module, forward, hidden, mask, kwargs)
    raise PlanError(
        f"packed rows through a Gated DeltaNet layer on {hidden.device.type}: the kernels here are "
        f"{kernel!r}; flash-linear-attention's delta rule keeps the samples apart, but the torch causal "
        "conv1d would mix them. Fix: install causal-conv1d (pip install 'dhp[gpu]'), or set "
        "data.packing=false."
    )


def _per_sample(
    module: nn.Module, forward, hidden: torch.Tensor, mask: torch.Tensor, kwargs: dict
) -> torch.Tensor:
    """transformers' forward on every sample alone; padding runs give zeros. The samples that span the
    same number of delta-rule chunks share one call, each in its own row, right-padded (0/1 mask) to the
    longest of them: as unpacked, a sample's padding comes after its tokens and is causally invisible,
    and the torch rule pads every row to whole chunks anyway."""
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for r in range(mask.shape[0]):
        for start, end, seg in segments(mask[r]):
            if seg:
                groups.setdefault(-(-(end - start) // DELTA_RULE_CHUNK), []).append((r, start, end))
    out = torch.zeros_like(hidden)
    for group in groups.values():
        width = max(end - start for _, start, end in group)
        src, dst = _gather_index(group, hidden.device)
        batch = hidden.new_zeros(len(group), width, hidden.shape[-1]).index_put(dst, hidden[src])
        pad = torch.zeros(len(group), width, dtype=torch.long, device=hidden.device).index_put(
            dst, torch.ones((), dtype=torch.long, device=hidden.device)
        )
        one = forward(module, batch, cache=None, attention_mask=None if bool(pad.all()) else pad, **kwargs)
        out = out.index_put(src, one[dst])
    return out


def _gather_index(
    group: list[tuple[int, int, int]], device: torch.device
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(row, column) indices of the ``(row, start, end)`` samples in the micro-batch, and of the same
    tokens in the group's batch (sample i in row i, from column 0)."""
    src_r = torch.cat([torch.full((e - s,), r) for r, s, e in group])
    src_c = torch.cat([torch.arange(s, e) for _, s, e in group])
    dst_r = torch.cat([torch.full((e - s,), i) for i, (_, s, e) in enumerate(group)])
    dst_c = torch.cat([torch.arange(e - s) for _, s, e in group])
    return (src_r.to(device), src_c.to(device)), (dst_r.to(device), dst_c.to(device))


def varlen_boundaries(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``cu_seqlens`` int64 ``(N + 1,)``, ``seq_idx`` int32 ``(1, B*S)``) of the micro-batch flattened
    to one row: one sequence per sample and per padding run of every row (``N`` runs in all)."""
    seq = mask.shape[1]
    bounds, lengths = [0], []
    for r in range(mask.shape[0]):
        for start, end, _ in segments(mask[r]):
            bounds.append(r * seq + end)
            lengths.append(end - start)
    cu = torch.tensor(bounds, dtype=torch.long, device=mask.device)
    runs = torch.arange(len(lengths), dtype=torch.int32, device=mask.device)
    seq_idx = torch.repeat_interleave(runs, torch.tensor(lengths, device=mask.device)).unsqueeze(0)
    return cu, seq_idx


def _varlen(
    module: nn.Module, forward, hidden: torch.Tensor, mask: torch.Tensor, kwargs: dict
) -> torch.Tensor:
    """One call on the flattened micro-batch with the kernels' varlen arguments."""
    batch, seq, width = hidden.shape
    cu, seq_idx = varlen_boundaries(mask)
    out = forward(
        module,
        hidden.reshape(1, batch * seq, width),
        cache=None,
        attention_mask=None,
        cu_seq_lens_q=cu,
        seq_idx=seq_idx,
        **kwargs,
    )
    return out.reshape(batch, seq, out.shape[-1])


def split_packed_rows(layer: nn.Module) -> nn.Module:
    """Make :func:`deltanet_forward` the forward of the plain Gated DeltaNet ``layer`` (no TP, no CP), in
    place. The TP style and context parallelism replace this forward with theirs, which call
    :func:`deltanet_forward` themselves."""
    layer.forward = types.MethodType(deltanet_forward, layer)
    return layer


__all__ = ["FLASH_VARLEN_KWARGS", "deltanet_forward", "split_packed_rows", "varlen_boundaries"]
