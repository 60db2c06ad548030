"""The evaluation's worker methods: a forward-only pass of a producer and of the consumer.

A mixin of :class:`dhp.runtime.worker.ModuleWorker` (its attributes: ``module``, ``links_out`` /
``links_in``, ``channel``, ``layout``, ``mesh``, ``device``, ``_assemble``). The driver
(``Trainer.evaluate``) brackets a pass with ``eval_begin`` / ``eval_end`` on every rank of every
group: between them each eval micro-batch runs the producers' forward and the consumer's forward
with its loss, under ``torch.no_grad`` and ``module.eval()`` (no dropout), over the same
parallelism, hand-off channel and routing as a training step. Nothing a step reads changes: no
gradient, no optimizer state, and ``eval_end`` puts back the RNG streams, the step timers and
events, the expert-load counters and each submodule's train/eval mode as ``eval_begin`` found
them, so the training losses after an eval are those of a run without it. Memory: one micro-batch's
activations at a time, freed after its forward (nothing is kept for a backward).
"""

from __future__ import annotations

from typing import Any

import ray
import torch
import torch.distributed as dist

from dhp import parallel as par
from dhp.checkpoint import capture_rng_state, restore_rng_state
from dhp.data.batch import VLBatch
from dhp.data.remote import resolve_pixels
from dhp.metrics.memory import reset_peak_memory
from dhp.runtime.device_io import shard_to, video_kwargs
from dhp.runtime.dispatch import Collect, Dispatch, register
from dhp.runtime.handoff import ProducerWork


class EvalMethods:
    """Forward-only methods of a module rank (see the module docstring)."""

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def eval_begin(self) -> None:
        """Keep what a forward may change (RNG, timers, events, expert counters, modes); eval mode."""
        load = self.expert_load
        self._eval_saved = {
            "rng": capture_rng_state(),
            "timers": dict(self._timers),
            "events": len(self._events),
            "expert_counts": None if load is None else load.counts,
            "training": {m: m.training for m in self.module.modules()},
        }
        if load is not None:
            load.counts = None
        self.module.eval()

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def eval_end(self) -> None:
        """Finish the channel's sends, put back everything ``eval_begin`` kept; the pass's peak
        memory is not counted in the next step's."""
        saved = self._eval_saved
        self.channel.drain()
        self.channel.release()
        for m, training in saved["training"].items():
            m.training = training
        restore_rng_state(saved["rng"])
        self._timers = saved["timers"]
        del self._events[saved["events"] :]
        if self.expert_load is not None:
            self.expert_load.counts = saved["expert_counts"]
        reset_peak_memory(self.device)
        self._eval_saved = None

    @register(dispatch=Dispatch.PER_RANK, collect=Collect.ALL)
    def eval_produce(self, work: ProducerWork, micro_batch: int, send: bool) -> Any:
        """The producer's forward of this rank's shard; one payload per consumer endpoint (None where
        no row goes, or when ``send`` is False), as :meth:`ModuleWorker.produce` without autograd."""
        (link,) = self.links_out
        payloads: list[Any] = [None] * work.num_endpoints
        if work.shard is not None:
            with torch.no_grad():
                outputs = self.module(**shard_to(resolve_pixels(work.shard), self.device).forward_kwargs())
            rows_all = link.pack(outputs)
            for route in work.routes if send else ():
                payload = self.channel.pack(
                    rows_all[route.src.to(self.device)],
                    to=(link.consumer, route.endpoint),
                    tag=micro_batch,
                    direction="fwd",
                )
                payloads[route.endpoint] = (payload, route.dst.numpy())
        return payloads[0] if len(payloads) == 1 else tuple(payloads)

    @register(dispatch=Dispatch.SHARD_BY_DP, collect=Collect.DP_LEADERS)
    def eval_consume(
        self, batch: VLBatch, inbox: dict[str, list[Any]], *, micro_batch: int
    ) -> dict[str, Any]:
        """The consumer's forward with its loss on one eval micro-batch: ``{loss_sum, num_tokens,
        aux_losses}`` of this rank's endpoint (``loss_sum`` with the router term, as in training)."""
        part = self.layout.coords(self.rank)["cp"]
        inbox = {p: parts[part] for p, parts in inbox.items()}
        group = par.inner_group(self.mesh, self.layout, ("sp", "tp"))  # the endpoint's other ranks
        reads = not self.channel.leader_only or group is None or dist.get_rank(group) == 0
        flat = [ref for refs in inbox.values() for ref in refs if ref is not None] if reads else []
        values = iter(ray.get(flat))
        got = (
            {p: [None if r is None else next(values) for r in refs] for p, refs in inbox.items()}
            if reads
            else {}
        )
        edge_inputs: dict[str, torch.Tensor | None] = {}
        for link in self.links_in:
            arrivals = got.get(link.producer)  # a runtime dict (None: nothing read here)
            leaf = (
                self._assemble(batch, link, arrivals, micro_batch, requires_grad=False, broadcast_in=group)
                if link.producer in inbox
                else None
            )
            edge_inputs.update(
                link.split(leaf) if leaf is not None else dict.fromkeys(e.kwarg for e in link.edges)
            )
        with torch.no_grad():
            out = self.module(**_forward_inputs(batch, self.device), **edge_inputs)
        return {
            "loss_sum": float(out.loss_sum),
            "num_tokens": int(out.num_tokens),
            "aux_losses": {k: float(v) for k, v in out.aux_losses.items()},
        }


def _forward_inputs(batch: VLBatch, device: torch.device) -> dict[str, Any]:
    """The consumer module's keyword inputs from a micro-batch (the hand-off rows come apart)."""
    grid = batch.image_grid_thw
    return {
        "input_ids": batch.input_ids.to(device),
        "attention_mask": batch.attention_mask.to(device),
        "labels": batch.labels.to(device),
        "mm_token_type_ids": batch.mm_token_type_ids.to(device),
        "image_grid_thw": None if grid is None else grid.to(device),
        "sample_ids": batch.sample_ids,
        **video_kwargs(batch, device),
    }
