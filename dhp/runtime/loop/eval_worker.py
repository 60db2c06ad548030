"""The evaluation's worker methods: a forward-only pass of a producer and of the consumer.

A mixin of :class:`dhp.runtime.loop.worker.ModuleWorker` (its attributes: ``module``, ``channel``,
``device``, ``_receive``, ``_edge_inputs``). The driver (``Trainer.evaluate``) brackets a pass with
``eval_begin`` / ``eval_end`` on every rank of every group: between them each eval micro-batch runs
the producers' forward without backward (``ModuleWorker.produce(backward=False)``, the payloads
tagged apart from a step's) and the consumer's forward with its loss (``eval_consume``), under
``torch.no_grad`` and ``module.eval()`` (no dropout), over the same parallelism, hand-off channel
and routing as a training step. Nothing a step reads changes: no
gradient, no optimizer state, and ``eval_end`` puts back the RNG streams, the step timers and
events, the expert-load counters and each submodule's train/eval mode as ``eval_begin`` found
them, so the training losses after an eval are those of a run without it. Memory: one micro-batch's
activations at a time, freed after its forward (nothing is kept for a backward).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dhp.checkpoint import capture_rng_state, restore_rng_state
from dhp.data.batch import VLBatch
from dhp.metrics.memory import reset_peak_memory
from dhp.parallel.pipeline import MicroBatch, forward_only, later_stages_take_rows, pipeline_group
from dhp.runtime.actors.dispatch import Collect, Dispatch, register
from dhp.runtime.handoff.device_io import batch_kwargs, hand_off_tag


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

    @register(dispatch=Dispatch.SHARD_BY_DP, collect=Collect.DP_LEADERS)
    def eval_consume(
        self, batch: VLBatch, inbox: dict[str, list[Any]], *, micro_batch: int
    ) -> dict[str, Any]:
        """The consumer's forward with its loss on one eval micro-batch: ``{loss_sum, num_tokens,
        aux_losses}`` of this rank's endpoint (``loss_sum`` with the router term, as in training)."""
        staged = self.layout.pp > 1
        if staged and not self.layout.is_first_stage(self.rank):  # the first stage's ranks take the rows
            got, group, reads = {p: [None] * len(r[0]) for p, r in inbox.items()}, None, False
        else:
            got, _, _, group, reads = self._receive(inbox)
        leaves, edge_inputs = self._edge_inputs(
            batch, got, hand_off_tag(micro_batch, False), reads=reads, requires_grad=False, broadcast_in=group
        )
        if staged:  # every stage in turn, the hidden states passed on
            if later_stages_take_rows(self.module, self.layout):
                group_pp = pipeline_group(self.mesh)
                for leaf in leaves.values():  # edge_inputs are views of these
                    if leaf is not None:
                        dist.broadcast(leaf, group=group_pp, group_src=0)
            kwargs = batch_kwargs(batch, self.device)
            ids = kwargs["input_ids"]
            return forward_only(
                self.module,
                self.mesh,
                self.layout,
                MicroBatch(inputs={**kwargs, **edge_inputs}, shape=(ids.shape[0], ids.shape[1])),
                hidden=self.hf_config.get_text_config().hidden_size,
                dtype=self.precision.compute_dtype,
                device=self.device,
            )
        with torch.no_grad():
            out = self.module(**batch_kwargs(batch, self.device), **edge_inputs)
        return {
            "loss_sum": float(out.loss_sum),
            "num_tokens": int(out.num_tokens),
            "aux_losses": {k: float(v) for k, v in out.aux_losses.items()},
        }
