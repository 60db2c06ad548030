"""The batch conventions that the data layer writes and a family's modules read.

``mm_token_type_ids`` values (``TEXT``, ``IMAGE``, ``VIDEO``, ``AUDIO``) and the packed-row mask: in a row's
``attention_mask`` 0 is padding and ``k >= 1`` the k-th sample packed into that row (docs/DATA.md,
"Packing"). ``dhp.data`` builds batches in this form (``dhp.data.batch``, ``dhp.data.packing``
re-export these names); a family reads them here, so ``dhp.models`` imports nothing from ``dhp.data``.
"""

from __future__ import annotations

import torch

TEXT, IMAGE, VIDEO, AUDIO = 0, 1, 2, 3  # mm_token_type_ids values


def is_packed(attention_mask: torch.Tensor) -> bool:
    """True when some row of ``attention_mask`` holds more than one sample (a value above 1)."""
    return bool(attention_mask.numel()) and int(attention_mask.max()) > 1


def segments(mask_row: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(start, end, segment)`` runs of one ``attention_mask`` row; segment 0 is padding."""
    row = mask_row.tolist()
    runs: list[tuple[int, int, int]] = []
    start = 0
    for t in range(1, len(row) + 1):
        if t == len(row) or row[t] != row[start]:
            runs.append((start, t, int(row[start])))
            start = t
    return runs


__all__ = ["AUDIO", "IMAGE", "TEXT", "VIDEO", "interleaved_videos", "is_packed", "segments"]


def interleaved_videos(mm_token_type_ids: torch.Tensor) -> torch.Tensor:
    """``(B,)`` bool: the sample holds a video interleaved with its audio track (a video token next to
    an audio token; a standalone audio sits between its start and end tokens, which are text)."""
    left, right = mm_token_type_ids[:, :-1], mm_token_type_ids[:, 1:]
    touch = ((left == VIDEO) & (right == AUDIO)) | ((left == AUDIO) & (right == VIDEO))
    return touch.any(dim=1)
