"""The cross-group hand-off of any row layout (``dhp.models.family.LAYOUTS``: image tokens, audio
tokens): which rows go from which producer rank to which consumer rank.

Routing (pure, driver side), from the plan's routing only (``Plan.routing``: which producer data
replicas serve each consumer replica). For micro-batch ``m`` every consumer data replica ``j`` has a
batch with items (images and videos, or audios: the producer's layout says which). A producer replica
that serves several consumer replicas takes all their items (in replica order); consumer replicas
served by several producer replicas have their items cut into contiguous blocks balanced by input
rows (patches, mel frames), one per serving replica. Inside a producer replica the family's SP cut
(``family.shard_items``) gives each SP rank the layout rows it outputs
(``token_index``). :func:`route_micro_batch` turns that into per-unit send lists: for each destination
endpoint, which local output rows go there and at which row of that endpoint's layout they land.

A consumer's endpoints are its units (one TP group each): one per data replica, or under context
parallelism one per (data replica, CP rank), each taking only the rows of its own tokens
(``consumer_split``: the CP cut of each replica's rows, ``dhp.parallel.cp.row_parts``).

Bytes. Each producer unit puts each row once (one payload per destination endpoint); all ranks of the
endpoint (its TP ranks) read that one payload. The gradient goes back from the endpoint's leader only,
cut per source unit, so no byte is sent twice in either direction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dhp.errors import RuntimeFailure
from dhp.layout import ParallelLayout

#: the family's SP cut of one producer replica's items: ``(input rows, meta rows, sp_size) -> shards``
ShardFn = Callable[[torch.Tensor, torch.Tensor, int], list[Any]]


@dataclass(frozen=True)
class Route:
    """Rows of one producer unit's output that go to one consumer endpoint.

    ``src``: row positions in the unit's local output; ``dst``: row positions in the consumer
    endpoint's layout (image-token order of its tokens of the micro-batch).
    """

    endpoint: int
    src: torch.Tensor
    dst: torch.Tensor


@dataclass(frozen=True)
class ProducerWork:
    """One producer unit's part of one micro-batch: its SP shard (or None: no images) and its routes."""

    shard: Any | None  # the family's input shard (``ProducerShard``)
    routes: tuple[Route, ...]
    num_tokens: int  # output rows of this unit
    num_endpoints: int = 1  # the consumer's endpoints (one payload slot each)


@dataclass(frozen=True)
class MicroBatchRouting:
    """Routing of one micro-batch. ``units[u]``; ``consumer_rows[e]`` = layout rows of consumer endpoint e."""

    units: tuple[ProducerWork, ...]
    consumer_rows: tuple[int, ...]

    def sources_of(self, endpoint: int) -> list[int]:
        """Producer units that send rows to consumer ``endpoint`` (in unit order)."""
        return [u for u, w in enumerate(self.units) if any(x.endpoint == endpoint for x in w.routes)]


def unit_senders(routing: MicroBatchRouting, endpoint: int, layout: ParallelLayout) -> list[int | None]:
    """Per producer unit, the producer rank whose payload consumer ``endpoint`` reads, or None.

    ``routing.units`` has one entry per unit (data replica x SP rank); the unit's TP ranks hold
    the same rows and only its TP rank 0 (``layout.unit_leader``) sends them. A unit index is a rank
    only when TP = 1, so the two must never be mixed.
    """
    if len(routing.units) != layout.num_units:
        raise RuntimeFailure(
            f"hand-off: routing has {len(routing.units)} producer units, the producer group has "
            f"{layout.num_units} (world {layout.world_size} / tp {layout.tp}) (a routing bug)"
        )
    srcs = set(routing.sources_of(endpoint))
    return [layout.unit_leader(u) if u in srcs else None for u in range(layout.num_units)]


def assign_images(patches: list[int], *, parts: int) -> list[int]:
    """Cut the ordered item list into ``parts`` contiguous blocks balanced by input rows (``patches``).

    Returns ``parts + 1`` boundaries into the item list. Greedy on cumulative patches: block k ends
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
    rows: list[torch.Tensor | None],
    meta: list[torch.Tensor | None],
    serving: Sequence[Sequence[int]],
    producer_replicas: int,
    sp_size: int,
    shard_fn: ShardFn,
    tokens_per_item: Callable[[torch.Tensor], list[int]],
    blank: tuple[torch.Tensor, torch.Tensor] | None = None,
    consumer_split: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    consumer_parts: int = 1,
) -> MicroBatchRouting:
    """Route one micro-batch (one entry per consumer replica) onto ``producer_replicas x sp_size`` units.

    ``rows[j]`` / ``meta[j]``: replica ``j``'s items' input rows and meta rows (the layout's batch
    fields, ``RowLayout.items``; item i has ``prod(meta[j][i])`` input rows); ``tokens_per_item``: the
    hand-off rows of each item from the meta rows.

    ``serving[j]``: the producer replicas that serve consumer replica ``j`` (``Plan.routing``).
    ``consumer_split[j]`` (context parallelism): per row of replica ``j``'s layout, the part (CP rank) that
    takes it and its row in that part's layout, of ``consumer_parts`` parts; then consumer endpoint
    ``j * consumer_parts + part`` gets it. None: one endpoint per replica.
    ``blank`` (``family.blank_input``): a producer replica that gets no item (fewer items than
    replicas, e.g. text-only samples) runs it and its output goes nowhere, its gradient is zero.
    Needed when the producer is FSDP-sharded across replicas: every replica must then take part in
    each forward's all-gathers and each backward's reduce-scatters, or its peers hang. None: such a
    replica's units get no work.

    Memory: builds each producer replica's input rows once (a concatenation of its items' rows);
    the SP cut copies only each rank's rows.
    """
    blocks, consumer_rows = _replica_blocks(
        rows, meta, serving=serving, producer_replicas=producer_replicas, tokens_per_item=tokens_per_item
    )
    units: list[ProducerWork] = []
    if consumer_split is not None:
        consumer_rows = _split_rows(consumer_split, consumer_rows, consumer_parts)
    n_end = len(consumer_rows)
    for block in blocks:
        if not block and blank is not None and any(consumer_rows):
            shards = shard_fn(blank[0], blank[1], sp_size)
            units.extend(
                ProducerWork(shard=sh, routes=(), num_tokens=sh.token_index.numel(), num_endpoints=n_end)
                for sh in shards
            )
        else:
            units.extend(
                _route_replica(
                    block,
                    sp_size=sp_size,
                    shard_fn=shard_fn,
                    split=consumer_split,
                    parts=consumer_parts,
                    n_end=n_end,
                )
            )
    return MicroBatchRouting(units=tuple(units), consumer_rows=tuple(consumer_rows))


def _replica_blocks(
    rows: list[torch.Tensor | None],
    meta: list[torch.Tensor | None],
    *,
    serving: Sequence[Sequence[int]],
    producer_replicas: int,
    tokens_per_item: Callable[[torch.Tensor], list[int]],
) -> tuple[list[list[tuple[int, torch.Tensor, torch.Tensor, int, int]]], list[int]]:
    """Each producer replica's items ``(consumer replica, meta row, input rows, dst offset, rows)``, the
    items of consumer replica ``j`` cut over the replicas serving it (:func:`assign_images`), and
    each consumer replica's hand-off row count. The input rows are views of ``rows``."""
    blocks: list[list[tuple[int, torch.Tensor, torch.Tensor, int, int]]] = [
        [] for _ in range(producer_replicas)
    ]
    consumer_rows = []
    for j, (pv, grid) in enumerate(zip(rows, meta, strict=True)):
        images, offset, row = [], 0, 0  # (replica j, meta row, input rows, dst offset, rows)
        counts = tokens_per_item(grid) if grid is not None else []
        for g, n_rows in zip(grid if grid is not None else [], counts, strict=True):
            n = int(g.prod())
            images.append((j, g, pv[row : row + n], offset, n_rows))
            row += n
            offset += n_rows
        consumer_rows.append(offset)
        serve = list(serving[j])
        cuts = assign_images([int(g.prod()) for _, g, _, _, _ in images], parts=len(serve))
        for k, v in enumerate(serve):
            blocks[v].extend(images[cuts[k] : cuts[k + 1]])
    return blocks, consumer_rows


def _split_rows(split, rows_per_replica, parts: int) -> list[int]:
    """Each endpoint's row count (replica-major, then part), from ``consumer_split``."""
    out_rows = []
    for j, (part, _) in enumerate(split):
        if part.numel() != rows_per_replica[j]:
            raise RuntimeFailure(
                f"hand-off: consumer replica {j} has {rows_per_replica[j]} rows, its context split "
                f"{part.numel()} (a routing bug)"
            )
        out_rows += [int((part == p).sum()) for p in range(parts)]
    return out_rows


def _route_replica(
    block, *, sp_size: int, shard_fn: ShardFn, split, parts: int, n_end: int
) -> list[ProducerWork]:
    """SP-shard one producer replica's items and map each unit's output rows to consumer endpoints."""
    if not block:
        return [ProducerWork(shard=None, routes=(), num_tokens=0, num_endpoints=n_end)] * sp_size
    shards = shard_fn(
        torch.cat([pv for _, _, pv, _, _ in block]), torch.stack([g for _, g, _, _, _ in block]), sp_size
    )
    # replica-local token position -> (consumer endpoint, dst row)
    dst_end, dst_row = [], []
    for j, _, _, offset, n in block:
        rows = torch.arange(offset, offset + n)
        if split is None:
            dst_end.append(torch.full((n,), j, dtype=torch.long))
            dst_row.append(rows)
        else:
            part, local = split[j]
            dst_end.append(j * parts + part[rows])
            dst_row.append(local[rows])
    end, row = torch.cat(dst_end), torch.cat(dst_row)
    out = []
    for shard in shards:
        idx = shard.token_index.long()
        routes = []
        for e in torch.unique(end[idx]).tolist():
            mask = end[idx] == e
            routes.append(Route(endpoint=e, src=torch.nonzero(mask).flatten(), dst=row[idx[mask]]))
        out.append(
            ProducerWork(shard=shard, routes=tuple(routes), num_tokens=idx.numel(), num_endpoints=n_end)
        )
    return out
