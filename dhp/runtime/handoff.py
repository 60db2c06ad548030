"""The cross-group hand-off: which image-embedding rows go from which encoder rank to which LLM rank.

Routing (pure, driver side). For micro-batch ``m`` every LLM data replica ``j`` has a batch with
images. The images of all replicas, in order, are cut into contiguous blocks balanced by patch
count, one block per vision data replica (N:M: a vision replica may serve several LLM replicas, or
an LLM replica's images may come from several vision replicas). Inside a vision replica the SP cut
(``dhp.parallel.shard_vision_batch``) gives each SP rank the merged-token positions it outputs
(``token_index``). :func:`route_micro_batch` turns that into per-vision-rank send lists: for each
destination LLM replica, which local output rows go there and at which row of that replica's
``image_embeds`` they land.

Bytes. Each vision rank puts each row once (one object per destination replica); all ranks of the
destination replica (its TP ranks) read that one object. The gradient goes back from the replica's
leader only, cut per source rank, so no byte is sent twice in either direction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhp.config.schema import VisionArch
from dhp.errors import RuntimeFailure
from dhp.parallel.sp_shard import VisionShard, shard_vision_batch
from dhp.runtime.dispatch import RankLayout


@dataclass(frozen=True)
class Route:
    """Rows of one vision rank's output that go to one LLM replica.

    ``src``: row positions in the vision rank's local output; ``dst``: row positions in the LLM
    replica's ``image_embeds`` (original token order of that replica's micro-batch).
    """

    llm_replica: int
    src: torch.Tensor
    dst: torch.Tensor


@dataclass(frozen=True)
class VisionWork:
    """One vision rank's part of one micro-batch: its SP shard (or None: no images) and its routes."""

    shard: VisionShard | None
    routes: tuple[Route, ...]
    num_tokens: int  # output rows of this rank


@dataclass(frozen=True)
class MicroBatchRouting:
    """Routing of one micro-batch. ``vision[rank]``; ``llm_tokens[j]`` = image tokens of LLM replica j."""

    vision: tuple[VisionWork, ...]
    llm_tokens: tuple[int, ...]

    def sources_of(self, llm_replica: int) -> list[int]:
        """Vision ranks that send rows to ``llm_replica`` (in rank order)."""
        return [r for r, w in enumerate(self.vision) if any(x.llm_replica == llm_replica for x in w.routes)]


def unit_senders(routing: MicroBatchRouting, llm_replica: int, layout: RankLayout) -> list[int | None]:
    """Per vision unit, the vision rank whose payload ``llm_replica`` reads, or None (sends nothing).

    ``routing.vision`` has one entry per unit (data replica x SP rank); the unit's TP ranks hold
    the same rows and only its TP rank 0 (``layout.unit_leader``) sends them. A unit index is a rank
    only when TP = 1, so the two must never be mixed.
    """
    if len(routing.vision) != layout.num_units:
        raise RuntimeFailure(
            f"hand-off: routing has {len(routing.vision)} vision units, the vision group has "
            f"{layout.num_units} (world {layout.world_size} / tp {layout.tp_size}) (a routing bug)"
        )
    srcs = set(routing.sources_of(llm_replica))
    return [layout.unit_leader(u) if u in srcs else None for u in range(layout.num_units)]


def assign_images(patches: list[int], *, parts: int) -> list[int]:
    """Cut the ordered image list into ``parts`` contiguous blocks balanced by patch count.

    Returns ``parts + 1`` boundaries into the image list. Greedy on cumulative patches: block k ends
    at the image boundary closest to ``(k+1)/parts`` of the total (some blocks may be empty when
    there are fewer images than parts).
    """
    total = sum(patches)
    prefix = [0]
    for p in patches:
        prefix.append(prefix[-1] + p)
    cuts = [0]
    for k in range(1, parts):
        target = k * total / parts
        best = min(range(cuts[-1], len(patches) + 1), key=lambda i: (abs(prefix[i] - target), i))
        cuts.append(best)
    cuts.append(len(patches))
    return cuts


def route_micro_batch(
    *,
    pixel_values: list[torch.Tensor | None],
    image_grid_thw: list[torch.Tensor | None],
    vision_replicas: int,
    sp_size: int,
    arch: VisionArch,
    pad_empty: bool = False,
) -> MicroBatchRouting:
    """Route one micro-batch (one entry per LLM replica) onto ``vision_replicas x sp_size`` ranks.

    ``pad_empty``: a vision replica that gets no image (fewer images than replicas, e.g. text-only
    samples) runs a one-merge-unit blank image whose output goes nowhere and whose gradient is zero.
    Needed when the encoder is FSDP-sharded across replicas: every replica must then take part in
    each forward's all-gathers and each backward's reduce-scatters, or its peers hang. The gradient
    is unchanged (exactly zero is added). Memory: one tiny image's activations on that replica.

    Memory: builds each vision replica's pixel rows once (a concatenation of its images' rows);
    the SP cut copies only each rank's rows.
    """
    merge = arch.spatial_merge_size**2
    images: list[tuple[int, torch.Tensor, torch.Tensor, int]] = []  # (replica, grid row, pixels, dst offset)
    llm_tokens = []
    for j, (pv, grid) in enumerate(zip(pixel_values, image_grid_thw, strict=True)):
        offset, row = 0, 0
        for g in grid if grid is not None else []:
            n = int(g.prod())
            images.append((j, g, pv[row : row + n], offset))
            row += n
            offset += n // merge
        llm_tokens.append(offset)
    cuts = assign_images([int(g.prod()) for _, g, _, _ in images], parts=vision_replicas)
    vision: list[VisionWork] = []
    for v in range(vision_replicas):
        block = images[cuts[v] : cuts[v + 1]]
        if not block and pad_empty and llm_tokens and any(llm_tokens):
            vision.extend(_blank_replica(sp_size=sp_size, arch=arch))
        else:
            vision.extend(_route_replica(block, sp_size=sp_size, merge=merge, arch=arch))
    return MicroBatchRouting(vision=tuple(vision), llm_tokens=tuple(llm_tokens))


def _blank_replica(*, sp_size: int, arch: VisionArch) -> list[VisionWork]:
    """SP shards of a blank image of one merge unit (``spatial_merge_size**2`` patches), no routes."""
    m = arch.spatial_merge_size
    patch_dim = arch.in_channels * arch.temporal_patch_size * arch.patch_size**2
    shards = shard_vision_batch(
        torch.zeros(m * m, patch_dim), torch.tensor([[1, m, m]]), sp_size=sp_size, arch=arch
    )
    return [VisionWork(shard=sh, routes=(), num_tokens=sh.token_index.numel()) for sh in shards]


def _route_replica(block, *, sp_size: int, merge: int, arch: VisionArch) -> list[VisionWork]:
    """SP-shard one vision replica's images and map each rank's output rows to LLM replicas."""
    if not block:
        return [VisionWork(shard=None, routes=(), num_tokens=0)] * sp_size
    shards = shard_vision_batch(
        torch.cat([pv for _, _, pv, _ in block]),
        torch.stack([g for _, g, _, _ in block]),
        sp_size=sp_size,
        arch=arch,
    )
    # replica-local token position -> (llm replica, dst row)
    dst_replica, dst_row = [], []
    for j, g, _, offset in block:
        n = int(g.prod()) // merge
        dst_replica.append(torch.full((n,), j, dtype=torch.long))
        dst_row.append(torch.arange(offset, offset + n))
    rep, row = torch.cat(dst_replica), torch.cat(dst_row)
    out = []
    for shard in shards:
        idx = shard.token_index.long()
        routes = []
        for j in torch.unique(rep[idx]).tolist():
            mask = rep[idx] == j
            routes.append(Route(llm_replica=j, src=torch.nonzero(mask).flatten(), dst=row[idx[mask]]))
        out.append(VisionWork(shard=shard, routes=tuple(routes), num_tokens=idx.numel()))
    return out
