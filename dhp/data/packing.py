"""Sequence packing: several samples in one LLM row, each attending only to itself.

A packed :class:`~dhp.data.batch.VLBatch` marks which sample every token belongs to in its
``attention_mask``: 0 is padding, ``k >= 1`` the k-th sample of the row (an unpacked row is the
special case of one sample, mask 1). The model side derives everything else from that mask:
per-sample M-RoPE positions (each sample as if alone) and the attention that never crosses a
sample (a block-diagonal mask, or varlen ``cu_seqlens`` for flash attention).

The first token of every packed sample carries label ``IGNORE_INDEX``: in a packed row the previous
sample's last token would otherwise predict it. Unpacked, that label is dropped by the causal shift
anyway, so the packed loss sum and label-token count equal the unpacked ones exactly (the loss
normaliser is unchanged). Images are concatenated in row-major sample order, the order in which
``masked_scatter`` consumes the image-token positions.

Memory: a packed micro-batch holds ``rows x longest row`` tokens instead of
``samples x longest sample``; the saving is the padding.
"""

from __future__ import annotations

import torch

from dhp.config.validate_data_keys import CONSUMER_SEQ_KEY, packed_row_tokens
from dhp.data.batch import IGNORE_INDEX, VIDEO, Sample, VLBatch
from dhp.errors import ConfigError, DataError
from dhp.ops.packed import is_packed, segments  # the one definition (re-exported here)


def pack_rows(lengths: list[int], *, max_tokens: int) -> list[list[int]]:
    """First-fit decreasing of sample indices into rows of at most ``max_tokens`` tokens: longest
    first (ties: stream order), each into the first row with room.

    Pure; every index appears once, each row lists its indices ascending. A sample longer than
    ``max_tokens`` is a DataError (the loader's limits keep samples within the consumer's
    ``seq_len``, and packing requires ``data.max_tokens`` >= it).
    """
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        n = lengths[i]
        if n > max_tokens:
            raise DataError(
                f"sample {i} of the micro-batch has {n} tokens > data.max_tokens={max_tokens}. "
                f"Fix: raise data.max_tokens to at least {CONSUMER_SEQ_KEY}"
            )
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(max_tokens - n)
    return [sorted(row) for row in rows]


def pack(samples: list[Sample], *, max_tokens: int, pad_token_id: int) -> VLBatch:
    """Pack ``samples`` into as few rows of ``<= max_tokens`` as first-fit decreasing gives, right-padded to the
    longest row. ``sample_ids`` holds one entry per row: the row's sample ids joined by ``+``."""
    if not samples:
        raise ValueError("pack() needs at least one sample")
    rows = pack_rows([s.num_tokens for s in samples], max_tokens=max_tokens)
    longest = max(sum(samples[i].num_tokens for i in row) for row in rows)
    shape = (len(rows), longest)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    mm_types = torch.zeros(shape, dtype=torch.long)
    ordered: list[Sample] = []
    for r, row in enumerate(rows):
        at = 0
        for k, i in enumerate(row):
            s = samples[i]
            n = s.num_tokens
            input_ids[r, at : at + n] = s.input_ids
            attention_mask[r, at : at + n] = k + 1
            labels[r, at + 1 : at + n] = s.labels[1:]
            mm_types[r, at : at + n] = s.mm_token_type_ids
            at += n
            ordered.append(s)
    return VLBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        labels=labels,
        mm_token_type_ids=mm_types,
        pixel_values=_cat([s.pixel_values for s in ordered]),
        image_grid_thw=_cat([s.image_grid_thw for s in ordered]),
        sample_ids=["+".join(samples[i].sample_id for i in row) for row in rows],
        second_per_grid_ts=_cat([s.second_per_grid_ts for s in ordered]),
    )


def unpack(batch: VLBatch) -> list[VLBatch]:
    """The samples of a packed batch as one-row batches (unpadded), in row-major order; images split
    along. The inverse of :func:`pack` up to each sample's first label (IGNORE in both forms' loss)."""
    grids = batch.image_grid_thw
    patch_counts = [] if grids is None else grids.prod(dim=1).tolist()
    out: list[VLBatch] = []
    img = patch = vid = 0
    ids = [i for row in batch.sample_ids for i in row.split("+")]
    for r in range(batch.input_ids.shape[0]):
        for start, end, seg in segments(batch.attention_mask[r]):
            if seg == 0:
                continue
            sl = slice(start, end)
            n_img = _images_in(batch, r, sl)
            n_patch = sum(patch_counts[img : img + n_img])
            n_vid = _videos_in(batch, r, sl)
            out.append(
                VLBatch(
                    input_ids=batch.input_ids[r : r + 1, sl].clone(),
                    attention_mask=torch.ones((1, end - start), dtype=torch.long),
                    labels=batch.labels[r : r + 1, sl].clone(),
                    mm_token_type_ids=batch.mm_token_type_ids[r : r + 1, sl].clone(),
                    pixel_values=None if not n_img else batch.pixel_values[patch : patch + n_patch],
                    image_grid_thw=None if not n_img else grids[img : img + n_img],
                    sample_ids=[ids[len(out)] if len(ids) > len(out) else f"row{r}[{start}:{end}]"],
                    second_per_grid_ts=None if not n_vid else batch.second_per_grid_ts[vid : vid + n_vid],
                )
            )
            img += n_img
            patch += n_patch
            vid += n_vid
    return out


def _videos_in(batch: VLBatch, row: int, sl: slice) -> int:
    """Videos whose tokens lie in ``input_ids[row, sl]``: runs of ``VIDEO`` type."""
    types = (batch.mm_token_type_ids[row, sl] == VIDEO).long()
    return int(((types[1:] == 1) & (types[:-1] == 0)).sum()) + int(types.numel() > 0 and types[0] == 1)


def _images_in(batch: VLBatch, row: int, sl: slice) -> int:
    """Visual items (images and videos) whose tokens lie in ``input_ids[row, sl]``: runs of
    non-text ``mm_token_type_ids``."""
    types = batch.mm_token_type_ids[row, sl]
    starts = (types[1:] != 0) & (types[1:] != types[:-1])
    return int(starts.sum()) + int(types.numel() > 0 and types[0] != 0)


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    kept = [p for p in parts if p is not None]
    return torch.cat(kept, dim=0) if kept else None


def packed_max_tokens(data, *, token_seq_len: int, seq_key: str = CONSUMER_SEQ_KEY) -> int:
    """The packed row length of ``data`` (DataConfig): 0 when packing is off, else ``data.max_tokens``
    (0 there: ``token_seq_len``, the consumer's ``seq_len``, key ``seq_key``). ConfigError when a sample
    could not fit a row (the config validation's rule,
    :func:`dhp.config.validate_data_keys.packed_row_tokens`)."""
    row, problems = packed_row_tokens(
        packing=data.packing, max_tokens=data.max_tokens, token_seq_len=token_seq_len, seq_key=seq_key
    )
    if problems:
        raise ConfigError(problems)
    return row


def unpacked(batch: VLBatch) -> list[VLBatch]:
    """``[batch]`` when it is not packed, else its samples one per batch (:func:`unpack`), pixels
    fetched first when they are an object-store reference (``data.engine=ray``)."""
    if not is_packed(batch.attention_mask):
        return [batch]
    from dataclasses import replace

    from dhp.data.remote import as_tensor

    return unpack(replace(batch, pixel_values=as_tensor(batch.pixel_values)))
