"""Where each token and each hand-off row of a micro-batch goes under context parallelism: the index
arithmetic of ``dhp.parallel.cp`` (torch only), which the driver's routing uses too.

A sequence of ``S`` tokens (right-padded to a multiple of ``2 * cp`` first) is cut into ``2 * cp``
contiguous chunks; CP rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (the causal load balance).
"""

from __future__ import annotations

import torch

from dhp.layout import padded_length

__all__ = ["chunk_bounds", "padded_length", "rank_index", "row_parts"]


def chunk_bounds(seq_len: int, cp: int) -> list[tuple[int, int]]:
    """The ``2 * cp`` contiguous chunks ``[start, end)`` of a sequence of ``seq_len`` tokens: sizes
    ``floor`` or ``ceil`` of ``seq_len / (2 cp)``, the longer ones first (empty when ``seq_len < 2 cp``)."""
    parts = 2 * cp
    base, extra = divmod(seq_len, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def rank_index(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global token indices CP rank ``rank`` holds, in its local order: chunk ``rank`` then chunk
    ``2 cp - 1 - rank`` (the causal load balance)."""
    bounds = chunk_bounds(seq_len, cp)
    (a0, a1), (b0, b1) = bounds[rank], bounds[2 * cp - 1 - rank]
    return torch.cat([torch.arange(a0, a1), torch.arange(b0, b1)]).to(device)


def row_parts(takes_rows: torch.Tensor, *, cp: int, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a micro-batch's hand-off rows go under context parallelism: for each row (the (B, S)
    ``takes_rows`` tokens, row-major, as the encoder's rows arrive), the CP rank whose tokens hold it and
    its row in that rank's layout (its local tokens, row by row, in local order). The module pads each
    micro-batch to a multiple of ``multiple`` first; padding takes no row."""
    b, seq = takes_rows.shape
    full = torch.zeros(b, padded_length(seq, multiple), dtype=torch.bool)
    full[:, :seq] = takes_rows.cpu()
    order = torch.full(full.shape, -1, dtype=torch.long)
    order[full] = torch.arange(int(full.sum()))
    part = torch.empty(int(full.sum()), dtype=torch.long)
    local = torch.empty_like(part)
    for r in range(cp):
        mine = order[:, rank_index(full.shape[1], cp, r)]
        rows = mine[mine >= 0]
        part[rows] = r
        local[rows] = torch.arange(rows.numel())
    return part, local
