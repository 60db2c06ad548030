"""Pure, driver-side sharding math for Ulysses SP of the Qwen2.5-VL-style vision encoder (a family's ``shard_inputs``).

No processes, no collectives: tensors in, tensors out. The driver (or any rank) calls
:func:`shard_vision_batch` once per micro-batch and sends each SP rank its :class:`VisionShard`.

Layout. transformers' vision forward permutes merge units (``spatial_merge_size**2`` consecutive patch
rows) into *window order* and runs window attention on contiguous windows of that order. We cut the
window order into ``sp_size`` contiguous slices on window boundaries, so window-attention blocks need no
communication; every cut is therefore also a multiple of the merge unit, so the patch merger runs
locally. Slices are balanced by patch count over all images of the micro-batch (optimal bottleneck,
then each cut as close as possible to its ideal prefix). With fewer windows than ranks some ranks get
no tokens; they still take part in the all-to-alls (see ``dhp.parallel.ulysses``).

Each rank receives its pixel rows in *original* order (only the bytes it needs) plus a local window
index that permutes them into its slice of the global window order. The HF forward then returns the
rank's merged tokens in ascending global order: ``token_index`` (global merged-token positions, as in
``pooler_output``). With ``sp_size=1`` this is the whole batch, HF's own window index, and
``token_index = arange``. ``arch``: the encoder's transformers config (Qwen2.5-VL's
``Qwen2_5_VLVisionConfig`` or Qwen2.5-Omni's ``Qwen2_5OmniVisionEncoderConfig``: the same geometry keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_position_ids,
    get_vision_window_index,
)

from dhp.errors import ConfigError, ConfigIssue, DataError
from dhp.parallel.ulysses import SPLIT_SIZES_KWARG


@dataclass(frozen=True)
class VisionShard:
    """What one SP rank needs for its part of a micro-batch's vision forward.

    ``pixel_values`` holds only this rank's patch rows (original order); ``position_ids`` are their
    rotary (h, w) coordinates; ``window_index``/``cu_window_seqlens`` describe this rank's windows
    locally; ``cu_seqlens``/``max_seqlen`` are the *global* full-attention segments (one per image
    frame), used after the all-to-all. ``split_sizes`` is the patch count of every SP rank.
    ``token_index`` (ascending) gives the global merged-token position of each output row.
    """

    rank: int
    sp_size: int
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    position_ids: torch.Tensor
    window_index: torch.Tensor
    cu_window_seqlens: torch.Tensor
    max_window_seqlen: int
    cu_seqlens: torch.Tensor
    max_seqlen: int
    split_sizes: tuple[int, ...]
    token_index: torch.Tensor
    num_tokens: int

    @property
    def num_patches(self) -> int:
        """Patch rows on this rank (0 for a rank with no tokens)."""
        return int(self.pixel_values.shape[0])

    def forward_kwargs(self) -> dict[str, object]:
        """Keyword arguments for ``VisionModule.forward`` / the HF vision forward.

        ``pixel_values`` and ``image_grid_thw`` plus the precomputed metadata the HF forward pops
        from its kwargs (``position_ids``, ``window_index``, ``cu_window_seqlens``, ``cu_seqlens``,
        max lengths). With ``sp_size > 1`` it also carries ``ulysses_split_sizes`` for the
        all-to-all attention installed by ``apply_ulysses_sp``.
        """
        kwargs: dict[str, object] = {
            "pixel_values": self.pixel_values,
            "image_grid_thw": self.image_grid_thw,
            "position_ids": self.position_ids,
            "window_index": self.window_index,
            "cu_window_seqlens": self.cu_window_seqlens,
            "max_window_seqlen": self.max_window_seqlen,
            "cu_seqlens": self.cu_seqlens,
            "max_seqlen": self.max_seqlen,
        }
        if self.sp_size > 1:
            kwargs[SPLIT_SIZES_KWARG] = self.split_sizes
        return kwargs


def balance_cuts(window_patches: Sequence[int], parts: int) -> list[int]:
    """Cut a sequence of window sizes into ``parts`` contiguous slices, balanced by patch count.

    Returns ``parts + 1`` window boundaries ``0 = c_0 <= ... <= c_parts = n``; slice k is windows
    ``[c_k, c_{k+1})`` and is empty only when there are fewer windows than parts. The largest slice is
    the smallest possible (optimal bottleneck); among such cuttings each cut is placed, in order, as
    close as possible to its ideal prefix ``k * total / parts`` (ties go to the later window).
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    sizes = [int(s) for s in window_patches]
    if any(s <= 0 for s in sizes):
        raise ValueError(f"window sizes must be positive, got {sizes}")
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    total = prefix[-1]
    cap = _min_bottleneck(sizes, parts)
    need = _segments_needed(prefix, cap)
    nonempty = n >= parts  # then every slice gets at least one window
    cuts = [0]
    for k in range(1, parts):
        prev = cuts[-1]
        lo, hi = (prev + 1, n - (parts - k)) if nonempty else (prev, n)
        candidates = [
            p for p in range(lo, hi + 1) if prefix[p] - prefix[prev] <= cap and need[p] <= parts - k
        ]
        cuts.append(min(candidates, key=lambda p: (abs(prefix[p] * parts - k * total), -p)))
    cuts.append(n)
    return cuts


def _min_bottleneck(sizes: list[int], parts: int) -> int:
    """Smallest cap such that ``sizes`` splits into <= ``parts`` contiguous runs each <= cap."""
    lo, hi = max(sizes, default=0), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        runs, acc = 1, 0
        for s in sizes:
            if acc + s > mid:
                runs, acc = runs + 1, 0
            acc += s
        if runs <= parts:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _segments_needed(prefix: list[int], cap: int) -> list[int]:
    """need[p]: fewest runs (each <= cap) covering windows p..n-1 (greedy is optimal)."""
    n = len(prefix) - 1
    need = [0] * (n + 1)
    nxt = n
    for p in range(n - 1, -1, -1):
        while prefix[nxt] - prefix[p] > cap:
            nxt -= 1
        need[p] = 1 + need[nxt]
    return need


def shard_vision_batch(
    pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, *, sp_size: int, arch: PretrainedConfig
) -> list[VisionShard]:
    """Split one micro-batch's patches over ``sp_size`` Ulysses ranks (pure; copies only each rank's rows).

    Returns one :class:`VisionShard` per SP rank. Raises :class:`DataError` for inconsistent pixel rows
    or grids, and :class:`ConfigError` for an invalid ``sp_size``.
    """
    if sp_size < 1:
        raise ConfigError(
            [ConfigIssue("modules.vision.parallel.sp", sp_size, "must be >= 1", "set sp to 1 or more")]
        )
    _check_inputs(pixel_values, image_grid_thw, arch)
    grid = image_grid_thw.to(device="cpu", dtype=torch.long)
    unit = arch.spatial_merge_size**2
    window_index, cu_window = get_vision_window_index(
        grid,
        spatial_merge_size=arch.spatial_merge_size,
        window_size=arch.window_size,
        patch_size=arch.patch_size,
    )
    cu_window = cu_window.to(torch.long)
    cu_seqlens = get_vision_cu_seqlens(grid)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    position_ids = get_vision_position_ids(grid, arch.spatial_merge_size)
    cuts = balance_cuts((cu_window[1:] - cu_window[:-1]).tolist(), sp_size)
    split_sizes = tuple(int(cu_window[cuts[r + 1]] - cu_window[cuts[r]]) for r in range(sp_size))
    shards = []
    for rank in range(sp_size):
        w_lo, w_hi = cuts[rank], cuts[rank + 1]
        units = window_index[int(cu_window[w_lo]) // unit : int(cu_window[w_hi]) // unit]
        token_index, order = torch.sort(units)
        local_window_index = torch.empty_like(order)
        local_window_index[order] = torch.arange(order.numel())
        rows = (token_index[:, None] * unit + torch.arange(unit)).reshape(-1).to(pixel_values.device)
        local_cu_window = (cu_window[w_lo : w_hi + 1] - cu_window[w_lo]).to(torch.int32)
        window_lengths = local_cu_window[1:] - local_cu_window[:-1]
        shards.append(
            VisionShard(
                rank=rank,
                sp_size=sp_size,
                pixel_values=pixel_values.index_select(0, rows),
                image_grid_thw=grid,
                position_ids=position_ids.index_select(0, rows.cpu()),
                window_index=local_window_index,
                cu_window_seqlens=local_cu_window,
                max_window_seqlen=int(window_lengths.max()) if window_lengths.numel() else 0,
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
                split_sizes=split_sizes,
                token_index=token_index,
                num_tokens=int(window_index.numel()),
            )
        )
    return shards


def _check_inputs(
    pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None, arch: PretrainedConfig
) -> None:
    """Raise DataError naming the mismatch between pixel rows, grids and the vision architecture."""
    if pixel_values is None or image_grid_thw is None:
        raise DataError(
            "shard_vision_batch: pixel_values and image_grid_thw are required; a micro-batch without "
            "images has no vision work. Fix: skip the vision forward for text-only micro-batches."
        )
    if image_grid_thw.ndim != 2 or image_grid_thw.shape[1] != 3 or image_grid_thw.shape[0] == 0:
        raise DataError(
            f"image_grid_thw has shape {tuple(image_grid_thw.shape)}; expected (N_images >= 1, 3) rows of "
            "(t, h, w) patches. Fix: build it with the Qwen2.5-VL image processor."
        )
    merge = arch.spatial_merge_size
    for i, (t, h, w) in enumerate(image_grid_thw.tolist()):
        if t < 1 or h % merge or w % merge or h < merge or w < merge:
            raise DataError(
                f"image_grid_thw[{i}] = {(t, h, w)}: h and w must be positive multiples of "
                f"spatial_merge_size={merge} and t >= 1. Fix: resize the image to a multiple of "
                f"{merge * arch.patch_size} px (the processor's smart_resize does this)."
            )
    row_width = arch.in_channels * arch.temporal_patch_size * arch.patch_size**2
    expected_rows = int(image_grid_thw.prod(dim=1).sum())
    if pixel_values.ndim != 2 or pixel_values.shape != (expected_rows, row_width):
        raise DataError(
            f"pixel_values has shape {tuple(pixel_values.shape)}; image_grid_thw implies "
            f"({expected_rows}, {row_width}) = (sum t*h*w, in_channels*temporal_patch_size*patch_size^2). "
            "Fix: pass the processor's flattened patches for exactly these images, in order."
        )
