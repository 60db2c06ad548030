"""The receiving side of the hand-off on a consumer rank: the payloads of its endpoint, read from
the channel (or broadcast by the endpoint's leader), assembled into one leaf per incoming link whose
gradient goes back to the producers, and the rows this rank's shard keeps under SP or CP.

A mixin of :class:`dhp.runtime.loop.worker.ModuleWorker` (its attributes: ``channel``, ``layout``,
``mesh``, ``links_in``, ``family``, ``hf_config``, ``precision``, ``_timers``). Memory: one
``(rows of the micro-batch, link width)`` leaf per link in the compute dtype.
"""

from __future__ import annotations

import time
from typing import Any

import ray
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dhp import parallel as par
from dhp.data.batch import VLBatch
from dhp.errors import RuntimeFailure
from dhp.models.family import LAYOUTS
from dhp.ops.context import padded_length, rank_index, row_parts
from dhp.runtime.handoff.graph import Link


class HandoffMethods:
    """Receive and assemble a consumer rank's hand-off rows (see the module docstring)."""

    def _receive(self, inbox: dict[str, list[Any]]) -> tuple[dict[str, list[Any]], dict, float, Any, bool]:
        """This rank's endpoint's payloads of ``inbox`` (waits for them): ``(got, inbox of this endpoint,
        seconds waited, the endpoint's other ranks' group, whether this rank reads the channel)``."""
        t0 = time.perf_counter()
        part = self.layout.coords(self.rank)["cp"]
        inbox = {p: parts[part] for p, parts in inbox.items()}
        group = par.inner_group(self.mesh, self.layout, ("sp", "tp"))  # the endpoint's other ranks
        reads = not self.channel.leader_only or is_root(group)
        # a leader-only channel: the other ranks of the replica read nothing (the leader broadcasts)
        flat = [ref for refs in inbox.values() for ref in refs if ref is not None] if reads else []
        self.faults.at("handoff")
        values = iter(ray.get(flat))
        got = {
            p: [None if ref is None or not reads else next(values) for ref in refs]
            for p, refs in inbox.items()
        }
        wait = time.perf_counter() - t0
        self._timers["wait_s"] += wait
        return got, inbox, wait, group, reads

    def _edge_inputs(
        self, batch: VLBatch, got: dict, tag: int, *, reads: bool, requires_grad: bool, broadcast_in: Any
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
        """(one leaf per incoming link, the module's edge keyword arguments: views of the leaves)."""
        leaves = {link.producer: self._assemble(batch, link, got[link.producer] if reads else None, tag,
                                                requires_grad=requires_grad, broadcast_in=broadcast_in)
                  for link in self.links_in if link.producer in got}  # fmt: skip
        edge_inputs: dict[str, torch.Tensor | None] = {}
        for link in self.links_in:
            leaf = leaves.get(link.producer)
            edge_inputs.update(
                link.split(leaf) if leaf is not None else dict.fromkeys(e.kwarg for e in link.edges)
            )
        return leaves, edge_inputs

    def _assemble(
        self,
        batch: VLBatch,
        link: Link,
        arrivals: list[Any] | None,
        micro_batch: int,
        *,
        requires_grad: bool,
        broadcast_in: Any = None,
    ) -> torch.Tensor | None:
        """The link's ``(rows of the micro-batch, link.width)`` leaf that collects the gradient.

        ``arrivals``: per producer unit ``(payload, dst rows)`` or None; each payload's rows land at its
        dst rows. ``arrivals`` None: this rank receives the whole tensor by a broadcast from rank 0 of
        ``broadcast_in`` (a leader-only channel: only the replica leader talks to it).
        """
        rows_layout = LAYOUTS[link.layout]
        if rows_layout.items(batch)[1] is None:  # no item of this layout in the micro-batch
            return None
        n = self._endpoint_rows(batch, link)
        # the leaf is in this module's compute dtype: its gradient rows go back in it too
        rows_all = torch.zeros(n, link.width, dtype=self.precision.compute_dtype, device=self.device)
        if arrivals is not None:
            filled = 0
            own = self._own_rows(batch, link) if not self.channel.leader_only else None
            for value in arrivals:
                if value is None:
                    continue
                payload, dst = value
                rows = self.channel.unpack(payload, device=self.device, tag=micro_batch, direction="fwd")
                filled += len(dst)
                dst = torch.from_numpy(dst)
                if own is not None:  # sequence parallel: copy only the rows of this rank's shard
                    keep = own[dst]
                    dst, rows = dst[keep], rows[keep.to(rows.device)]
                rows_all[dst.to(self.device)] = rows.to(rows_all.dtype)
                self._timers["handoff_bytes"] += rows.numel() * rows.element_size()
            if filled != n:
                raise RuntimeFailure(
                    f"module {self.module_name!r} rank {self.rank}: hand-off delivered {filled} rows from "
                    f"{link.producer!r}, the micro-batch {batch.sample_ids} has {n} (a routing bug)"
                )
        if self.channel.leader_only and broadcast_in is not None:
            dist.broadcast(rows_all, group=broadcast_in, group_src=0)
        return rows_all.requires_grad_(requires_grad)

    def _endpoint_rows(self, batch: VLBatch, link: Link) -> int:
        """Hand-off rows of ``link`` this rank's endpoint takes of ``batch``: every row of its layout, or
        under context parallelism those of this CP rank's tokens (``dhp.ops.context.row_parts``)."""
        lay, rows_layout = self.layout, LAYOUTS[link.layout]
        if lay.cp == 1:
            meta = rows_layout.items(batch)[1]
            return sum(self.family.tokens_per_item(link.producer, self.hf_config, meta))
        positions = rows_layout.positions(batch.mm_token_type_ids)
        part, _ = row_parts(positions, cp=lay.cp, multiple=lay.token_multiple)
        return int((part == lay.coords(self.rank)["cp"]).sum())

    def _own_rows(self, batch: VLBatch, link: Link) -> torch.Tensor | None:
        """Sequence parallelism inside TP: a bool mask over the endpoint's rows of ``link``, True
        for the rows whose tokens fall into this TP rank's sequence shard (the only rows the LLM reads
        here; the rest are cut away before layer 0). None without SP: every row is needed. Under context
        parallelism the shard is of this CP rank's tokens."""
        lay = self.layout
        if lay.seq_split == 1:
            return None
        types = batch.mm_token_type_ids  # the layout's positions are those of its token types
        if lay.cp > 1:  # the CP rank's tokens of the padded micro-batch, in their local order
            seq = padded_length(types.shape[1], lay.token_multiple)
            types = F.pad(types, (0, seq - types.shape[1]), value=-1)[
                :, rank_index(seq, lay.cp, lay.coords(self.rank)["cp"])
            ]
        return par.sequence_shard_rows(
            types,
            LAYOUTS[link.layout].token_types,
            tp=lay.tp,
            rank=self.mesh["tp"].get_local_rank(),
        )


def is_root(group: Any) -> bool:
    """True without a group, or on the group's rank 0 (the one that talks to the bridge)."""
    return group is None or dist.get_rank(group) == 0
