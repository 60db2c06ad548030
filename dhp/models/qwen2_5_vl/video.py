"""Qwen2.5-VL video at the LLM: which visual items of a micro-batch are videos, and their time axis.

The data layer keeps every visual item of a micro-batch (images and videos) in one ordered stream:
``pixel_values`` rows and ``image_grid_thw`` rows item after item, in the row-major order of their
token runs, so the encoder and the hand-off treat a video as an image with ``t > 1`` temporal patches
(transformers' encoder does exactly that for ``pixel_values_videos``). The LLM tells them apart by the
token run each item fills (``mm_token_type_ids`` 1 image, 2 video; ``<|image_pad|>`` or
``<|video_pad|>``) and hands transformers' ``get_rope_index`` the image grids, the video grids and
``second_per_grid_ts`` (seconds per temporal patch, one per video) separately, so a video's temporal
M-RoPE positions advance by ``tokens_per_second * second_per_grid_ts`` per temporal patch.
"""

from __future__ import annotations

import itertools

import torch

from dhp.errors import DataError

VIDEO_TYPE = 2


def item_types(mm_token_type_ids: torch.Tensor) -> list[int]:
    """The modality (1 image, 2 video) of every visual item, in row-major token-run order."""
    return [key for row in mm_token_type_ids.tolist() for key, _ in itertools.groupby(row) if key != 0]


def split_visual(
    *,
    mm_token_type_ids: torch.Tensor | None,
    grids: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(image grids, video grids, seconds per video grid)`` from the ordered item stream.

    DataError when the number of token runs and grids differ, or when videos come without their
    ``second_per_grid_ts`` (the temporal positions would silently assume 1 s per temporal patch).
    """
    if grids is None or mm_token_type_ids is None:
        return grids, None, None
    kinds = item_types(mm_token_type_ids)
    if len(kinds) != grids.shape[0]:
        raise DataError(
            f"{len(kinds)} visual token runs (images + videos) but {grids.shape[0]} grids were given. "
            "Fix: keep one grid per image or video, in the order of their tokens (dhp.data does)"
        )
    is_video = torch.tensor([k == VIDEO_TYPE for k in kinds], device=grids.device)
    if not bool(is_video.any()):
        return grids, None, None
    n_video = int(is_video.sum())
    if second_per_grid_ts is None or second_per_grid_ts.numel() != n_video:
        got = None if second_per_grid_ts is None else second_per_grid_ts.numel()
        raise DataError(
            f"{n_video} video(s) in the micro-batch but second_per_grid_ts has {got} entries. "
            "Fix: pass one second_per_grid_ts per video (temporal_patch_size / sampled fps)"
        )
    images = grids[~is_video]
    return (images if images.shape[0] else None), grids[is_video], second_per_grid_ts
