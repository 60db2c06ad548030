"""The driver's step over the module graph (the algorithm of ``dhp.runtime.loop.driver``'s docstring):
the step-statistics pass, per micro-batch the producers' forward, the consumer's forward and
backward and the producers' backward, then the gradient sync, the clip and the optimizer update.

A mixin of :class:`dhp.runtime.loop.driver.Trainer` (its attributes: ``groups``, ``consumer``,
``links``, ``serving``, ``family``, ``hf_config``, ``modules_cfg``, ``train_cfg``, ``batch_terms``,
``_backprops``, ``_timeout``, ``faults``). Memory on the driver: the routing tensors of one step
and object refs; hand-off rows never pass through it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dhp.data import StepData
from dhp.errors import PlanError, RuntimeFailure
from dhp.models.family import LAYOUTS
from dhp.ops.context import row_parts
from dhp.runtime.handoff.routing import route_micro_batch, unit_senders
from dhp.runtime.loop.driver_pipeline import PipelineStep
from dhp.runtime.loop.worker import ModuleWorker


class NonFiniteStep(RuntimeFailure):
    """A non-finite loss or grad norm: deterministic, so restarting from a checkpoint would repeat it."""


@dataclass
class StepResult:
    """One optimizer step as the driver saw it (``grads`` only when asked, before clipping)."""

    loss: float
    grad_norm: float
    num_label_tokens: int
    step_s: float
    driver_s: float  # driver-side routing and bookkeeping
    consumer_wait_s: float  # LLM ranks waiting for embeddings (max over replica leaders, summed over m)
    stats: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # per module, per rank
    grads: dict[str, dict[str, torch.Tensor]] | None = None
    # unweighted auxiliary losses of the loss module (an MoE router's), label-token-weighted over the step
    aux_losses: dict[str, float] = field(default_factory=dict)


class TrainerStep(PipelineStep):
    """One optimizer step across the actor groups (see the module docstring)."""

    def step(self, data: StepData, *, lr: float, collect_grads: bool = False) -> StepResult:
        """Run one optimizer step on ``data``; a non-finite loss or grad norm stops before the update."""
        t0 = time.perf_counter()
        driver_s = 0.0
        td = time.perf_counter()
        whole_step = self._statistics_pass(data)  # the batch terms over the step (several micro-batches)
        driver_s += time.perf_counter() - td
        if self.consumer.layout.pp > 1:  # one pipeline schedule over the step's micro-batches
            consumed, produce_s = self._pipelined(data, whole_step)
        else:
            consumed, produce_s = self._interleaved(data, whole_step)
        driver_s += produce_s
        leaders = self._consumer_leaders()  # one per endpoint: each holds its own tokens' loss
        stats = [
            self.consumer.get([p.ref(r, 0) for r in leaders], what="consume", timeout_s=self._timeout)
            for p in consumed
        ]
        loss_sum = sum(s["loss_sum"] for per_m in stats for s in per_m)
        wait_s = sum(max(s["wait_s"] for s in per_m) for per_m in stats)
        loss = loss_sum / data.num_label_tokens
        norm_sq = self._finalize_grads()
        norm = math.sqrt(norm_sq) if norm_sq >= 0 else float("nan")
        if not (math.isfinite(loss) and math.isfinite(norm)):
            for g in self.groups.values():
                g.call(ModuleWorker.zero_grads)
            raise NonFiniteStep(
                f"step {data.step + 1}: non-finite {'loss' if not math.isfinite(loss) else 'grad norm'} "
                f"(loss={loss}, grad_norm={norm}); the update was not applied. Samples: "
                f"{[sid for mb in data.micro_batches for b in mb for sid in b.sample_ids]}. Fix: lower "
                "train.lr, check the data, or use fp32 (model.dtype=float32) to find the overflow."
            )
        grads = (
            {n: g.call(ModuleWorker.full_grads) for n, g in self.groups.items()} if collect_grads else None
        )
        clip = self.train_cfg.grad_clip
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        update = [g.submit(ModuleWorker.optimizer_step, lr=lr, clip_coef=coef) for g in self.groups.values()]
        for p in update:
            p.group.collect(p, timeout_s=self._timeout)
        step_stats = {n: g.call(ModuleWorker.take_stats) for n, g in self.groups.items()}
        self.faults.step_done()
        return StepResult(
            loss=loss,
            grad_norm=norm,
            num_label_tokens=data.num_label_tokens,
            step_s=time.perf_counter() - t0,
            driver_s=driver_s,
            consumer_wait_s=wait_s,
            stats=step_stats,
            grads=grads,
            aux_losses=_aux_losses(stats, data.num_label_tokens),
        )

    def _interleaved(self, data: StepData, whole_step: bool) -> tuple[list[Any], float]:
        """Per micro-batch: the producers' forward (the next one's overlapping the consumer's work),
        the consumer's forward and backward, the producers' backward; (the consumer's pendings, the
        driver's seconds issuing the producers)."""
        micro_batches = len(data.micro_batches)
        sent: list[dict[str, Any] | None] = [None] * micro_batches
        consumed: list[Any] = []
        driver_s = 0.0
        for m in range(micro_batches):
            td = time.perf_counter()
            if sent[m] is None:
                sent[m] = self._produce(data, m)
            if m + 1 < micro_batches:
                sent[m + 1] = self._produce(data, m + 1)  # overlaps the consumer's work on m
            driver_s += time.perf_counter() - td
            consumed.append(self._consume(data, m, sent[m], step_statistics=whole_step))
            self._backprop(m, sent[m], consumed[-1])
        return consumed, driver_s

    def _statistics_pass(self, data: StepData) -> bool:
        """Issue the step-statistics pass (module docstring) when the step needs it; whether it did.

        Needed when the consumer has loss terms defined on a batch, ``train.router_aux_loss`` is ``step``
        and a replica's batch is cut into several micro-batches (one micro-batch: its forward already
        sees the step's tokens), or the consumer has pipeline stages (each stage sees only its own
        layers' routers: one ``statistics_pipeline`` call runs the pass of the whole step). Per micro-batch: each producer's forward without gradient, then the
        consumer's ``statistics_pass``; no wait (the actors run them before the step's own calls)."""
        staged = self.consumer.layout.pp > 1
        if not self.batch_terms or self.train_cfg.router_aux_loss != "step":
            if staged and self.batch_terms:  # validation refuses it first; never train a different loss
                raise PlanError(
                    "an MoE router's load-balancing loss per micro-batch under pipeline parallelism: each "
                    "stage takes its share from the step's routing sums. Fix: train.router_aux_loss=step."
                )
            return False
        if staged:  # one pass for the step: the pipeline's stages each add their layers' sums
            self._statistics_pipeline(data)
            return True
        if len(data.micro_batches) < 2:
            return False
        for m in range(len(data.micro_batches)):
            sent = self._produce(data, m, backward=False)
            self._backprops.append(  # awaited with the backwards, before the grads are reduced
                self.consumer.submit(
                    ModuleWorker.statistics_pass, data.micro_batches[m], self._inboxes(sent), micro_batch=m
                )
            )
        return True

    def _produce(self, data: StepData, m: int, *, backward: bool = True) -> dict[str, Any]:
        """Route micro-batch ``m`` and issue every producer's forward on its ranks (no wait); without
        gradient and kept activations for the statistics pass (``backward=False``).

        Returns ``{producer: (routing, pending)}`` for the producers with work: a producer whose
        layout has no item in the micro-batch (no image, or no audio, in any replica) runs nothing."""
        batches = data.micro_batches[m]
        out = {}
        consumer = self.consumer.layout
        for link in self.links:
            rows_layout = LAYOUTS[link.layout]
            items = [rows_layout.items(b) for b in batches]
            if all(meta is None for _, meta in items):
                continue
            split = None  # context parallelism: each CP rank of a consumer replica takes its own tokens' rows
            if consumer.cp > 1:
                split = [
                    row_parts(
                        rows_layout.positions(b.mm_token_type_ids),
                        cp=consumer.cp,
                        multiple=consumer.token_multiple,
                    )
                    for b in batches
                ]
            group = self.groups[link.producer]
            layout, world = group.layout, group.layout.world_size
            sp = layout.sp
            routing = route_micro_batch(  # one unit per (data replica, SP rank); TP ranks of a unit share it
                rows=[r for r, _ in items],
                meta=[g for _, g in items],
                serving=self.serving[link.producer],
                producer_replicas=layout.num_replicas,
                sp_size=sp,
                shard_fn=lambda pv, g, n, name=link.producer: self.family.shard_items(
                    name, self.hf_config, rows=pv, meta=g, sp_size=n
                ),
                tokens_per_item=lambda g, name=link.producer: self.family.tokens_per_item(
                    name, self.hf_config, g
                ),
                # FSDP collectives span replicas: a replica without items runs a blank one
                blank=self.family.blank_input(link.producer, self.hf_config) if layout.fsdp > 1 else None,
                consumer_split=split,
                consumer_parts=consumer.cp,
            )
            out[link.producer] = (
                routing,
                group.submit(
                    ModuleWorker.produce,
                    [routing.units[layout.unit_of(r)] for r in range(world)],
                    [m] * world,
                    [
                        layout.unit_leader(layout.unit_of(r)) == r for r in range(world)
                    ],  # only TP rank 0 sends
                    backward=backward,
                    num_returns=consumer.num_units,  # one payload per consumer endpoint
                ),
            )
        return out

    def _grads_wanted(self, sent: dict[str, Any]) -> bool:
        return bool(sent) and any(not self.modules_cfg[p].freeze for p in sent)

    def _inboxes(self, sent: dict[str, Any]) -> list[dict[str, list[list[Any]]]]:
        """Per consumer replica, per producer, per consumer endpoint of it (one; under context
        parallelism one per CP rank), the refs of the payloads each producer unit sent there."""
        replicas, parts = self.consumer.layout.num_replicas, self.consumer.layout.cp
        inboxes: list[dict[str, list[list[Any]]]] = [{} for _ in range(replicas)]
        for producer, (routing, pending) in sent.items():
            layout = self.groups[producer].layout
            for j in range(replicas):  # one entry per producer unit, read from the unit's sending rank
                inboxes[j][producer] = [
                    [None if s is None else pending.ref(s, e) for s in unit_senders(routing, e, layout)]
                    for e in range(j * parts, (j + 1) * parts)
                ]
        return inboxes

    def _consume(self, data: StepData, m: int, sent: dict[str, Any], *, step_statistics: bool) -> Any:
        """Issue the consumer's forward+backward of micro-batch ``m``; each replica gets its senders' refs
        (:meth:`_inboxes`). ``step_statistics``: its batch terms over the step (the statistics pass ran)."""
        grads = self._grads_wanted(sent)
        units = sum(self.groups[p].layout.num_units for p in sent)
        return self.consumer.submit(
            ModuleWorker.consume,
            data.micro_batches[m],
            self._inboxes(sent),
            micro_batch=m,
            num_label_tokens=data.num_label_tokens,
            grads=grads,
            step_statistics=step_statistics,
            num_returns=1 + units if grads else 1,
        )

    def _backprop(self, m: int, sent: dict[str, Any], consumed: Any) -> None:
        """Issue each producer's backward of ``m`` with the gradient rows each of its ranks needs."""
        if not self._grads_wanted(sent):
            return
        leaders = self._consumer_leaders()
        offset = 1  # the consumer returns (stats, grads of the first producer's units, the next's, ...)
        for producer in sent:
            group = self.groups[producer]
            layout, world = group.layout, group.layout.world_size
            if not self.modules_cfg[producer].freeze:
                grad_refs = [
                    [consumed.ref(j, offset + layout.unit_of(r)) for j in leaders] for r in range(world)
                ]
                self._backprops.append(group.submit(ModuleWorker.backprop, [m] * world, grad_refs))
            offset += layout.num_units

    def _consumer_leaders(self) -> list[int]:
        """The consumer's endpoint leaders: TP rank 0 of each unit (one per data replica, or per
        (replica, CP rank) under context parallelism), in endpoint order."""
        lay = self.consumer.layout
        return [lay.unit_leader(u) for u in range(lay.num_units)]

    def _finalize_grads(self) -> float:
        """Wait for every backward, reduce grads in each group (concurrently), sum the squared norms."""
        for p in self._backprops:
            p.group.collect(p, timeout_s=self._timeout)
        self._backprops = []
        pend = {n: g.submit(ModuleWorker.finalize_grads) for n, g in self.groups.items()}
        return sum(g.collect(pend[n], timeout_s=self._timeout) for n, g in self.groups.items())


def _aux_losses(stats: list[list[dict[str, Any]]], num_label_tokens: int) -> dict[str, float]:
    """Each auxiliary loss over the step: per micro-batch the value its term was computed on (the same
    on every replica leader: over the step's tokens after a statistics pass, so the same in every
    micro-batch too; else over the micro-batch's tokens of all replicas), weighted by the leaders'
    label tokens, over the step's ``T``, as the loss weights its term."""
    out: dict[str, float] = {}
    for per_m in stats:
        for s in per_m:
            for name, value in s["aux_losses"].items():
                out[name] = out.get(name, 0.0) + value * s["num_tokens"] / max(num_label_tokens, 1)
    return out
