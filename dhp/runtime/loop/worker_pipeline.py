"""The consumer's step under pipeline parallelism: every micro-batch of this replica's step through
one pipeline schedule (``dhp.parallel.pipeline``), the hand-off rows in and their gradients out.

A mixin of :class:`dhp.runtime.loop.worker.ModuleWorker` (the receiving side of
:class:`~dhp.runtime.loop.worker_handoff.HandoffMethods`; its attributes ``module``, ``mesh``,
``layout``, ``links_in``, ``channel``, ``precision``, ``_timers``, ``_events``). Every rank of a
pipeline reads the micro-batches; the hand-off rows go to the first stage's ranks only (its endpoints,
as without stages), and down the pipeline by a broadcast only where a later stage adds DeepStack
features; then the rows' gradients are summed over the pipeline (the embedding's on the first stage,
DeepStack's where its layers are), and the first stage's endpoint leader sends them back. Memory: every micro-batch's hand-off leaves until
the schedule ends, and the activations of the micro-batches the schedule keeps in flight.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from dhp import parallel as par
from dhp.data.batch import VLBatch
from dhp.metrics import accounting
from dhp.parallel.pipeline import (
    MicroBatch,
    broadcast_stats,
    later_stages_take_rows,
    pipeline_group,
    route_statistics_pass,
    run_pipeline,
)
from dhp.runtime.actors.dispatch import Collect, Dispatch, register
from dhp.runtime.handoff.device_io import batch_kwargs as _batch_kwargs
from dhp.runtime.handoff.device_io import hand_off_tag as _tag


class PipelineMethods:
    """The pipelined ``consume`` of a whole step (see the module docstring)."""

    @register(dispatch=Dispatch.SHARD_BY_DP, collect=Collect.DP_LEADERS)
    def consume_pipeline(
        self,
        batches: list[VLBatch],
        inboxes: list[dict[str, list[Any]]],
        *,
        num_label_tokens: int,
        grads: list[bool],
        units: list[int],
        step_statistics: bool = False,
    ) -> tuple[Any, ...]:
        """Forward + backward of this replica's micro-batches ``batches`` (with their ``inboxes``, as
        :meth:`consume` takes one) through the pipeline schedule. ``grads[m]``: whether micro-batch m's
        hand-off rows need gradients; ``units``: per incoming link, its producer's units (the payload
        slots); ``step_statistics``: the module's batch terms over the step, from the sums of this
        step's :meth:`statistics_pipeline`. Returns, per micro-batch, ``stats`` then one gradient
        payload per unit of every link (None where nothing goes back), flattened: ``M x (1 +
        sum(units))`` values."""
        later = later_stages_take_rows(self.module, self.layout)
        wall, t0 = time.time(), time.perf_counter()
        micro, received = self._pipeline_inputs(batches, inboxes, grads=grads, tag=lambda m: m)
        step = self._step_statistics(num_label_tokens) if step_statistics else None
        if step is not None:  # every stage's router share from the step's sums (statistics_pipeline)
            for mb in micro:
                mb.inputs["step_statistics"] = step
        t1 = time.perf_counter()
        self.faults.at("forward")
        with torch.set_grad_enabled(True), accounting.saving(self._acct):
            run_pipeline(
                self.module,
                self.mesh,
                self.layout,
                micro,
                rank=self.rank,
                hidden=self.hf_config.get_text_config().hidden_size,
                dtype=self.precision.compute_dtype,
                num_label_tokens=num_label_tokens,
                device=self.device,
            )
        accounting.sample(self._acct)
        self._timers["fwd_s"] += time.perf_counter() - t1  # forward and backward interleave in a schedule
        self._timers["wait_s"] += t1 - t0
        out = self._pipeline_returns(micro, received, grads=grads, units=units, later=later)
        self._events.append(("consume", 0, wall, time.time()))
        return tuple(out)

    @register(dispatch=Dispatch.SHARD_BY_DP, collect=Collect.NONE)
    def statistics_pipeline(self, batches: list[VLBatch], inboxes: list[dict[str, list[Any]]]) -> None:
        """The step-statistics pass under pipeline parallelism (:meth:`statistics_pass`'s role, for the
        whole step at once): every micro-batch forward without gradient, stage by stage, each stage
        adding its layers' routing sums; the step's sums over every stage land in this rank's
        ``_step_sums``. The expert-load counters skip it; memory: one stage's forward at a time."""
        wall, t0 = time.time(), time.perf_counter()
        micro, _ = self._pipeline_inputs(
            batches, inboxes, grads=[False] * len(batches), tag=lambda m: _tag(m, False)
        )
        for mb in micro:
            mb.inputs["batch_statistics"] = True
        self.faults.at("statistics")
        with par.expert_load_paused(self.expert_load):
            values = route_statistics_pass(
                self.module, self.mesh, self.layout, micro,
                hidden=self.hf_config.get_text_config().hidden_size,
                dtype=self.precision.compute_dtype, device=self.device,
            )  # fmt: skip
        self._step_sums = values.double().cpu()
        self._timers["fwd_s"] += time.perf_counter() - t0
        self._events.append(("statistics", 0, wall, time.time()))

    def _pipeline_inputs(
        self, batches: list[VLBatch], inboxes: list[dict[str, list[Any]]], *, grads: list[bool], tag: Any
    ) -> tuple[list[MicroBatch], list[tuple[Any, Any, dict, float]]]:
        """Each micro-batch's inputs for the stages, and per micro-batch (payloads, this endpoint's
        inbox, the hand-off leaves, seconds waited): the first stage's ranks read the channel (the
        hand-off's endpoints); a later stage gets the rows by a broadcast down its pipeline only where
        it adds DeepStack features."""
        pp_group = pipeline_group(self.mesh)
        first = self.layout.is_first_stage(self.rank)
        later = later_stages_take_rows(self.module, self.layout)
        micro, received = [], []
        for m, (batch, inbox) in enumerate(zip(batches, inboxes, strict=True)):
            if first:
                got, inbox_e, wait, group, reads = self._receive(inbox)
            else:
                got, inbox_e, wait, group, reads = (
                    {p: [None] * len(r[0]) for p, r in inbox.items()},
                    {},
                    0.0,
                    None,
                    False,
                )
            leaves, edge_inputs = self._edge_inputs(
                batch, got, tag(m), reads=reads, requires_grad=grads[m], broadcast_in=group
            )
            if later:
                for leaf in leaves.values():
                    if leaf is not None:
                        dist.broadcast(leaf.data, group=pp_group, group_src=0)
            kwargs = _batch_kwargs(batch, self.device)
            ids = kwargs["input_ids"]
            micro.append(MicroBatch(inputs={**kwargs, **edge_inputs}, shape=(ids.shape[0], ids.shape[1])))
            received.append((got, inbox_e, leaves, wait))
        return micro, received

    def _pipeline_returns(
        self, micro: list[MicroBatch], received: list, *, grads: list[bool], units: list[int], later: bool
    ) -> list[Any]:
        """Per micro-batch its statistics (every stage's loss part, the last stage's counts) and the
        gradient payloads of its hand-off rows (summed over the pipeline where later stages used them;
        sent by the first stage's endpoint leaders), flattened as :meth:`consume_pipeline` returns."""
        pp_group = pipeline_group(self.mesh)
        all_stats = broadcast_stats(
            [m.stats for m in micro], pp_group, src=self.layout.pp - 1, device=self.device
        )
        out: list[Any] = []
        leader = self.layout.unit_leader(self.layout.unit_of(self.rank)) == self.rank
        for m, (got, _inbox, leaves, wait) in enumerate(received):
            out.append(all_stats[m] | {"wait_s": wait})
            for leaf in leaves.values() if later else ():
                if leaf is not None and grads[m]:
                    g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                    dist.all_reduce(g, group=pp_group)  # each stage's part of the rows' gradient
                    leaf.grad = g
            for link, n in zip(self.links_in, units, strict=True):
                per_unit: list[Any] = [None] * n
                leaf = leaves.get(link.producer)
                for u, value in enumerate(got.get(link.producer, [])):
                    if grads[m] and leader and leaf is not None and value is not None:
                        rows = link.grad_of(leaf.grad)[torch.from_numpy(value[1]).to(self.device)]
                        per_unit[u] = self.channel.pack(rows, to=(link.producer, u), tag=m, direction="bwd")
                out += per_unit
        return out
