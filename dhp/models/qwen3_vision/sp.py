"""Pure, driver-side cut of one micro-batch's images over the vision SP ranks (no processes).

The Qwen3 vision encoder (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5) has full attention in every block and no window reordering, so a shard is simply a
contiguous slice of the patch rows, cut on merge-unit boundaries (``spatial_merge_size**2`` consecutive
rows, which the processor emits together): the patch embedding, the position-table lookup, norms, MLPs,
the merger and every DeepStack merger (if any) then run on the rank's own rows, and only the attention needs the
other ranks (Ulysses all-to-alls, applied from outside by ``dhp.parallel``). Each rank's output rows are
its merged tokens ``token_index`` (ascending), the same rows for ``image_embeds`` and every
``deepstack_embeds_k``. Slices are balanced by patch count; a rank may get none (fewer merge units
than ranks) and still joins the collectives.

Each shard carries what the transformers vision model's forward would compute from the whole
batch's ``grid_thw``, sliced to the rank's rows: the bilinear position-table taps and weights
(``interp_indices``/``interp_weights``) and the rotary (h, w) ``position_ids``; plus the *global*
per-image ``cu_seqlens`` the attention uses after the all-to-all. The forward pops them from its kwargs,
so the module's own forward runs at every SP degree (no bypass).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

from dhp.errors import DataError
from dhp.parallel.ulysses import SPLIT_SIZES_KWARG


@dataclass(frozen=True)
class Qwen3VisionShard:
    """One SP rank's part of a micro-batch's vision forward (a :class:`dhp.models.family.ProducerShard`)."""

    rank: int
    sp_size: int
    pixel_values: torch.Tensor  # (rows, C*T*P*P), this rank's patch rows
    image_grid_thw: torch.Tensor  # (N_images, 3), the whole micro-batch
    interp_indices: torch.Tensor  # (rows, 4) taps into the learned position table
    interp_weights: torch.Tensor  # (rows, 4)
    position_ids: torch.Tensor  # (rows, 2) rotary (h, w) coordinates
    cu_seqlens: torch.Tensor  # (N_frames + 1,) global attention segments
    max_seqlen: int
    split_sizes: tuple[int, ...]  # patch rows of every SP rank
    token_index: torch.Tensor  # (rows / merge**2,) ascending merged-token rows of the whole input
    num_tokens: int

    @property
    def num_patches(self) -> int:
        return int(self.pixel_values.shape[0])

    def forward_kwargs(self) -> dict[str, object]:
        """Keyword arguments of ``VisionModule.forward`` for this rank."""
        kwargs: dict[str, object] = {
            "pixel_values": self.pixel_values,
            "image_grid_thw": self.image_grid_thw,
            "interp_indices": self.interp_indices,
            "interp_weights": self.interp_weights,
            "position_ids": self.position_ids,
            "cu_seqlens": self.cu_seqlens,
            "max_seqlen": self.max_seqlen,
        }
        if self.sp_size > 1:
            kwargs[SPLIT_SIZES_KWARG] = self.split_sizes
        return kwargs


def balanced_unit_cuts(units: int, parts: int) -> list[int]:
    """``parts + 1`` cut points over ``units`` merge units: contiguous slices differing by at most one."""
    base, rest = divmod(units, parts)
    cuts = [0]
    for k in range(parts):
        cuts.append(cuts[-1] + base + (1 if k < rest else 0))
    return cuts


def shard_images(
    pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, *, sp_size: int, config: PretrainedConfig
) -> list[Qwen3VisionShard]:
    """Cut the micro-batch's patch rows into ``sp_size`` contiguous, merge-unit-aligned shards (one per rank).

    Memory: each shard's per-row tensors are copies of its own rows, not views. A view would keep the
    storage of the whole micro-batch: shipping the shard to its rank would send every rank's rows, and
    the patch embedding, which saves its input for backward, would hold all of them.
    """
    merge = config.spatial_merge_size
    unit = merge * merge
    rows = int(pixel_values.shape[0])
    if sp_size < 1:
        raise DataError(f"sp_size must be >= 1, got {sp_size}")
    if rows != int(image_grid_thw.prod(-1).sum()) or rows % unit:
        raise DataError(
            f"pixel_values has {rows} patch rows but image_grid_thw {image_grid_thw.tolist()} describes "
            f"{int(image_grid_thw.prod(-1).sum())} (a multiple of spatial_merge_size**2 = {unit} is needed). "
            f"Fix: pass the grid the processor returned with these pixels."
        )
    side = int(config.num_position_embeddings**0.5)
    indices, weights = get_vision_interpolation_indices_and_weights(
        image_grid_thw, num_grid_per_side=side, mode="bilinear", align_corners=True, spatial_merge_size=merge
    )
    position_ids = get_vision_position_ids(image_grid_thw, merge)
    seqlens = torch.repeat_interleave(image_grid_thw[:, 1] * image_grid_thw[:, 2], image_grid_thw[:, 0])
    cu_seqlens = F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0), value=0)
    max_seqlen = int(seqlens.max()) if len(seqlens) else 0
    cuts = [c * unit for c in balanced_unit_cuts(rows // unit, sp_size)]
    split_sizes = tuple(b - a for a, b in itertools.pairwise(cuts))
    return [
        Qwen3VisionShard(
            rank=r,
            sp_size=sp_size,
            pixel_values=pixel_values[a:b].clone(),
            image_grid_thw=image_grid_thw,
            interp_indices=indices[a:b].clone(),
            interp_weights=weights[a:b].clone(),
            position_ids=position_ids[a:b].clone(),
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            split_sizes=split_sizes,
            token_index=torch.arange(a // unit, b // unit, dtype=torch.long),
            num_tokens=rows // unit,
        )
        for r, (a, b) in enumerate(itertools.pairwise(cuts))
    ]
