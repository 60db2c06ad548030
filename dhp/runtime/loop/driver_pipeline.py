"""The driver's step when the consumer has pipeline stages (a mixin of
:class:`~dhp.runtime.loop.driver_step.TrainerStep`, with its attributes): every producer forward of
the step first (the encoders run ahead), the consumer's one pipeline schedule over all its
micro-batches (``ModuleWorker.consume_pipeline``), then each micro-batch's producer backward; the
step-statistics pass as one ``statistics_pipeline`` call. Memory on the driver: object refs only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from dhp.data import StepData
from dhp.runtime.loop.worker import ModuleWorker


class PipelineStep:
    """The pipelined consumer's side of the driver's step (see the module docstring)."""

    def _pipelined(self, data: StepData, whole_step: bool) -> tuple[list[Any], float]:
        """Every producer forward first (the encoders run ahead), then the consumer's one pipeline
        schedule over the step, then each micro-batch's producer backward; (per micro-batch a view of
        the consumer's returns, the driver's seconds issuing the producers)."""
        td = time.perf_counter()
        sent = [self._produce(data, m) for m in range(len(data.micro_batches))]
        driver_s = time.perf_counter() - td
        consumed = self._consume_pipeline(data, sent, step_statistics=whole_step)
        for m, views in enumerate(consumed):
            self._backprop(m, sent[m], views)
        # every stage's rank, not only the first stage's leaders: a later stage's failure at once
        world = self.consumer.layout.world_size
        self.consumer.get([consumed[0].ref(r, 0) for r in range(world)], what="consume_pipeline",
                          timeout_s=self._timeout)  # fmt: skip
        return consumed, driver_s

    def _statistics_pipeline(self, data: StepData) -> None:
        """Issue the step-statistics pass through the consumer's pipeline (no wait): the producers'
        forwards without gradient, then one call that runs every micro-batch stage by stage."""
        sent = [self._produce(data, m, backward=False) for m in range(len(data.micro_batches))]
        replicas = self.consumer.layout.num_replicas
        self._backprops.append(  # awaited with the backwards, before the grads are reduced
            self.consumer.submit(
                ModuleWorker.statistics_pipeline,
                [[mb[j] for mb in data.micro_batches] for j in range(replicas)],
                [[self._inboxes(s)[j] for s in sent] for j in range(replicas)],
            )
        )

    def _consume_pipeline(
        self, data: StepData, sent: list[dict[str, Any]], *, step_statistics: bool
    ) -> list[Any]:
        """Issue the consumer's pipelined forward+backward of every micro-batch of the step (one call,
        ``ModuleWorker.consume_pipeline``); per micro-batch a view of its returns shaped as
        :meth:`_consume`'s (stats, then the gradient payloads of the producers in ``sent[m]``)."""
        links = [link.producer for link in self.links]
        units = [self.groups[p].layout.num_units for p in links]
        per_m = 1 + sum(units)
        micro_batches = len(data.micro_batches)
        replicas = self.consumer.layout.num_replicas
        inboxes = [self._inboxes(sent[m]) for m in range(micro_batches)]
        pending = self.consumer.submit(
            ModuleWorker.consume_pipeline,
            [[data.micro_batches[m][j] for m in range(micro_batches)] for j in range(replicas)],
            [[inboxes[m][j] for m in range(micro_batches)] for j in range(replicas)],
            num_label_tokens=data.num_label_tokens,
            grads=[self._grads_wanted(sent[m]) for m in range(micro_batches)],
            units=units,
            step_statistics=step_statistics,
            num_returns=micro_batches * per_m,
        )
        views = []
        for m in range(micro_batches):
            slots = [0]  # stats, then per producer with work its units' slots, in link order
            offset = 1
            for producer, n in zip(links, units, strict=True):
                if producer in sent[m]:
                    slots += range(offset, offset + n)
                offset += n
            views.append(_Returns(pending, [m * per_m + k for k in slots]))
        return views


@dataclass
class _Returns:
    """One micro-batch's returns among a pipelined call's (``ref(rank, k)``: its k-th value)."""

    pending: Any
    slots: list[int]

    def ref(self, rank: int, k: int) -> Any:
        return self.pending.ref(rank, self.slots[k])
