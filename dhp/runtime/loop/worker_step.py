"""One training step on a module rank: the producer's forward and its backward from the
consumer's gradient rows (the hand-back), the consumer's forward and backward with the loss, the
step-statistics pass, the gradient sync and the optimizer update.

A mixin of :class:`dhp.runtime.loop.worker.ModuleWorker` (its attributes: ``module``, ``optimizer``,
``channel``, ``links_in``/``links_out``, ``_inflight``, ``_timers``, ``_events``; the receiving side
of the hand-off: :class:`dhp.runtime.loop.worker_handoff.HandoffMethods`). Memory: the activations of
at most two micro-batches in flight (the producer keeps its outputs until ``backprop``).
"""

from __future__ import annotations

import time
from typing import Any

import ray
import torch
import torch.distributed as dist

from dhp import parallel as par
from dhp.data.batch import VLBatch
from dhp.data.remote import resolve_pixels
from dhp.errors import RuntimeFailure
from dhp.metrics import accounting
from dhp.models.family import StepStatistics
from dhp.runtime.actors.dispatch import Collect, Dispatch, register
from dhp.runtime.handoff.device_io import batch_kwargs as _batch_kwargs
from dhp.runtime.handoff.device_io import hand_off_tag as _tag
from dhp.runtime.handoff.device_io import shard_to as _shard_to
from dhp.runtime.handoff.routing import ProducerWork
from dhp.runtime.loop.worker_handoff import is_root


class StepMethods:
    """Forward, backward and update of one module's shard (see the module docstring)."""

    @register(dispatch=Dispatch.PER_RANK, collect=Collect.ALL)
    def produce(self, work: ProducerWork, micro_batch: int, send: bool, *, backward: bool = True) -> Any:
        """Run this rank's input shard through the module; return one payload per consumer replica.

        The module returns ``{kwarg: (rows, width)}`` for its edges; the link's payload to a replica is
        its routed rows of all edges, concatenated (``Link.pack``), or None when no row goes there, or
        when ``send`` is False (TP ranks > 0 of a unit hold the same rows as its rank 0). Activations
        stay here until ``backprop``. ``backward=False`` (the step-statistics pass): no gradient, nothing
        kept, the payloads tagged apart from the micro-batch's own (:func:`_tag`).
        """
        t0, wall = time.perf_counter(), time.time()
        self.faults.at("produce")
        (link,) = self.links_out  # one consumer per producer (the graph's loss module)
        payloads: list[Any] = [None] * work.num_endpoints
        if work.shard is not None:
            with torch.set_grad_enabled(backward and not self.frozen):
                shard = _shard_to(
                    resolve_pixels(work.shard), self.device
                )  # data.engine=ray: rows from the store
                with accounting.saving(self._acct if backward else None):
                    outputs = self.module(**shard.forward_kwargs())
            if backward and not self.frozen:
                self._inflight[micro_batch] = (outputs, work)
            # the rows travel in the compute dtype (the planner's hand-off bytes)
            rows_all = link.pack({k: t.detach().to(self.precision.compute_dtype) for k, t in outputs.items()})
            for route in work.routes if send else ():
                rows = rows_all[route.src.to(self.device)]
                payload = self.channel.pack(
                    rows, to=(link.consumer, route.endpoint), tag=_tag(micro_batch, backward), direction="fwd"
                )
                payloads[route.endpoint] = (payload, route.dst.numpy())
        self._timers["fwd_s"] += time.perf_counter() - t0
        self._events.append(("produce" if backward else "produce_statistics", micro_batch, wall, time.time()))
        return payloads[0] if len(payloads) == 1 else tuple(payloads)

    @register(dispatch=Dispatch.PER_RANK, collect=Collect.NONE)
    def backprop(self, micro_batch: int, grad_refs: list[Any]) -> None:
        """Backpropagate the consumer's gradient rows for this rank's outputs (one ref per consumer
        replica it fed; with a leader-only channel the unit leader receives and broadcasts to its TP peers)."""
        entry = self._inflight.pop(micro_batch, None)
        if entry is None or self.frozen:
            return
        outputs, work = entry
        (link,) = self.links_out
        t0 = time.perf_counter()
        tp_group = par.inner_group(self.mesh, self.layout, ("tp",))
        reads = not self.channel.leader_only or is_root(tp_group)
        self.faults.at("handback")
        got = ray.get(grad_refs) if reads and grad_refs else []
        self._timers["wait_s"] += time.perf_counter() - t0
        t1 = time.perf_counter()
        rows = next(iter(outputs.values())).shape[0]
        ref = next(iter(outputs.values()))
        grad = torch.zeros(rows, link.grad_width, dtype=ref.dtype, device=ref.device)
        by_endpoint = {r.endpoint: r for r in work.routes}
        for e, payload in enumerate(got):
            if payload is not None:
                g = self.channel.unpack(payload, device=self.device, tag=micro_batch, direction="bwd")
                grad[by_endpoint[e].src.to(self.device)] = g.to(grad.dtype)
        if self.channel.leader_only and tp_group is not None and work.routes:
            dist.broadcast(grad, group=tp_group, group_src=0)
        torch.autograd.backward(*link.backward_pairs(outputs, grad))
        accounting.sample(self._acct)
        self._timers["bwd_s"] += time.perf_counter() - t1

    @register(dispatch=Dispatch.SHARD_BY_DP, collect=Collect.DP_LEADERS)
    def consume(
        self,
        batch: VLBatch,
        inbox: dict[str, list[Any]],
        *,
        micro_batch: int,
        num_label_tokens: int,
        grads: bool,
        step_statistics: bool = False,
    ) -> Any:
        """Forward + backward of one micro-batch with ``loss_sum / T``; returns stats and grad payloads.

        ``inbox``: per producer, per endpoint of this replica (one; one per CP rank under context
        parallelism), one payload ref per producer unit (None where it sends nothing): this rank reads
        its own endpoint's. Returns ``(stats, grad_0, ..., grad_{U-1})`` over the units of every incoming
        link in link order when ``grads``, else ``stats``. Only the endpoint's leader (TP rank 0 of its
        unit) sends gradient rows (its TP ranks hold identical ones). ``step_statistics``: the module's
        terms defined on a batch are taken over the step, from the sums of this step's
        :meth:`statistics_pass` (``dhp.models.family.StepStatistics``).
        """
        got, inbox, wait, group, reads = self._receive(inbox)
        wall = time.time()  # the event starts after its inputs arrived
        t1 = time.perf_counter()
        leaves, edge_inputs = self._edge_inputs(
            batch, got, micro_batch, reads=reads, requires_grad=grads, broadcast_in=group
        )
        step = self._step_statistics(num_label_tokens) if step_statistics else None
        self.faults.at("forward")
        with torch.set_grad_enabled(True), accounting.saving(self._acct):
            out = self.module(
                **_batch_kwargs(batch, self.device),
                **({} if step is None else {"step_statistics": step}),
                **edge_inputs,
            )
        t2 = time.perf_counter()
        self._timers["fwd_s"] += t2 - t1
        loss = out.loss_sum / num_label_tokens
        self.faults.at("backward")
        if loss.requires_grad:
            loss.backward()
            accounting.sample(self._acct)
        self._timers["bwd_s"] += time.perf_counter() - t2
        self._events.append(("consume", micro_batch, wall, time.time()))
        stats = {"loss_sum": float(out.loss_sum.detach()), "num_tokens": int(out.num_tokens), "wait_s": wait,
                 "aux_losses": {k: float(v) for k, v in out.aux_losses.items()}}  # fmt: skip
        if not grads:
            return stats
        leader = self.layout.unit_leader(self.layout.unit_of(self.rank)) == self.rank
        payloads: list[Any] = []
        for link in self.links_in:  # per unit of the producer: its rows' gradients, from the leader only
            per_unit: list[Any] = [None] * len(inbox.get(link.producer, []))
            leaf = leaves.get(link.producer)
            for u, value in enumerate(got.get(link.producer, [])):
                if leader and leaf is not None and value is not None:
                    rows = link.grad_of(leaf.grad)[torch.from_numpy(value[1]).to(self.device)]
                    per_unit[u] = self.channel.pack(
                        rows, to=(link.producer, u), tag=micro_batch, direction="bwd"
                    )
            payloads += per_unit
        return (stats, *payloads)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def batch_terms(self) -> tuple[str, ...]:
        """The module's loss terms defined on a batch (``dhp.models.family.StepStatistics``); () for a
        producer, or a loss without one (the driver runs :meth:`statistics_pass` only for these)."""
        return tuple(getattr(self.module, "batch_terms", ()))  # a loss module without the attribute has none

    @register(dispatch=Dispatch.SHARD_BY_DP, collect=Collect.NONE)
    def statistics_pass(self, batch: VLBatch, inbox: dict[str, list[Any]], *, micro_batch: int) -> None:
        """The step-statistics pass of micro-batch ``micro_batch`` (every micro-batch of the step, before
        any :meth:`consume` of it): the module's forward WITHOUT gradient on the producers' rows of
        their ``produce(backward=False)``, returning its batch statistics over the module's token ranks;
        added to this rank's step sums (reset at micro-batch 0). Nothing is kept for backward; the
        expert-load counters skip this forward (the real one counts). Cost: one forward of the module
        per micro-batch (no LM head or loss); memory: that forward's transients only.
        """
        got, _, _, group, reads = self._receive(inbox)
        wall, t1 = time.time(), time.perf_counter()
        _, edge_inputs = self._edge_inputs(
            batch, got, _tag(micro_batch, False), reads=reads, requires_grad=False, broadcast_in=group
        )
        self.faults.at("statistics")
        with torch.no_grad(), par.expert_load_paused(self.expert_load):
            values = self.module(**_batch_kwargs(batch, self.device), batch_statistics=True, **edge_inputs)
        values = values.double().cpu()
        self._step_sums = values if micro_batch == 0 or self._step_sums is None else self._step_sums + values
        self._timers["fwd_s"] += time.perf_counter() - t1
        self._events.append(("statistics", micro_batch, wall, time.time()))

    def _step_statistics(self, num_label_tokens: int) -> StepStatistics:
        """This step's :class:`~dhp.models.family.StepStatistics` (the sums of its statistics pass)."""
        if self._step_sums is None:
            raise RuntimeFailure(
                f"module {self.module_name!r} rank {self.rank}: asked for the step's statistics before any "
                "statistics_pass of the step (a driver bug)"
            )
        return StepStatistics(values=tuple(self._step_sums.tolist()), num_label_tokens=num_label_tokens)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def finalize_grads(self) -> float:
        """Reduce grads over SP/DP (sums) and return the module's squared grad norm (same on all ranks)."""
        self.channel.drain()  # every backward ran: each send has been received
        norm_sq = 0.0
        if not self.frozen:
            t0 = time.perf_counter()
            par.finalize_grads(self.module, self.mesh, self.layout)
            norm_sq = float(par.grad_norm_sq(self.module, self.mesh))
            self._timers["step_s"] += time.perf_counter() - t0
        self.faults.at("grad_sync")  # after the sync's collectives: a hang here is this rank's alone
        return norm_sq

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def optimizer_step(self, *, lr: float, clip_coef: float) -> None:
        """Scale grads by ``clip_coef`` (< 1 when clipping), AdamW step at ``lr``, zero the grads."""
        self.faults.at("optimizer")
        self.channel.release()
        if self.optimizer is not None:
            t0 = time.perf_counter()
            if clip_coef < 1.0:
                par.clip_grads_(self.module, clip_coef)
            par.set_lr(self.optimizer, lr)  # lr x each param group's lr_scale
            self.optimizer.step()
            accounting.sample(self._acct)
            self.optimizer.zero_grad(set_to_none=True)
            self._timers["step_s"] += time.perf_counter() - t0
        self.faults.step_done()

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def zero_grads(self) -> None:
        """Drop this step's gradients and in-flight activations (a step refused before the update)."""
        self._inflight.clear()
        self.channel.abandon()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)
