"""The driver step, reading like the algorithm in docs/ARCHITECTURE.md, over the family's module graph.

The graph: producer groups (e.g. the vision encoder) feed the consumer group (the module with the
loss, e.g. the LLM) over links (``dhp.runtime.handoff.graph``: every edge of one producer -> consumer,
moved as one payload). Per micro-batch ``m`` (gradient accumulation over ``m``):

    work    = route(micro_batch m)                    # driver: Plan.routing + the family's SP cut (pure)
    sent    = producer.produce(work)                  # each unit puts its rows once, per consumer replica
    grads   = consumer.consume(batch, sent)           # backprops loss_sum / T; returns d/d(rows) per unit
    producer.backprop(grads)

then ``norm = sqrt(sum of every group's grad_norm_sq)``, clip, AdamW at the scheduled lr.

Nothing blocks between the calls: Ray orders them by their data dependencies. The producers'
forward of micro-batch m+1 is issued before the consumer's work on m, so when the groups sit on
different devices they overlap (each actor runs its calls in issue order: F0 F1 B0 F2 B1 ...).
The payloads are the channel's (``dhp.runtime.handoff.transport``: object store, CUDA IPC or the bridge,
chosen by the plan); the driver routes their refs and never looks inside one. Memory on the
driver: the routing tensors of one step and object refs; hand-off rows never pass through it.

A loss term defined on a batch (an MoE router's load-balancing loss) is taken over the STEP's batch,
as the LM loss's mean is over its ``T`` label tokens. With one micro-batch per consumer replica the
consumer's forward all-reduces what the term needs over its token ranks, so nothing changes. With
several (and ``train.router_aux_loss=step``, the default) a statistics pass runs first: per micro-batch
every producer's forward without gradient and the consumer's forward without gradient, which sums the
term's statistics (the routers' counts) over the step; the loop above then gives every micro-batch the
step's sums (``dhp.models.family.StepStatistics``), so the loss and every gradient are those of the
step's batch in one call. Cost: one more forward of every module per micro-batch (the consumer's
without its LM head), about a third more compute per step; memory: those forwards' transients only
(the encoder's activations are not kept across the pass, they are recomputed by its real forward).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import ray
import torch

from dhp.config.schema import ModuleConfig, RunConfig
from dhp.data import StepData
from dhp.plan import Plan
from dhp.runtime.actors.actor_group import ActorGroup, release, reserve, specs_from_plan
from dhp.runtime.actors.failures import FaultHook
from dhp.runtime.actors.stacks import RankStack, read_stacks
from dhp.runtime.launch.forknodes import NodeForkServers, start_for_cluster
from dhp.runtime.launch.forkserver import preload_family
from dhp.runtime.launch.startup import Startup, connect_ray
from dhp.runtime.loop.driver_start import TrainerStart
from dhp.runtime.loop.driver_step import TrainerStep
from dhp.runtime.loop.evaluation import EvalParts, EvalResult
from dhp.runtime.loop.worker import ModuleWorker


class Trainer(TrainerStart, TrainerStep):
    """The actor groups of one run and the step across them. ``close()`` frees everything. Composed
    by concern: start-up and build (:class:`~dhp.runtime.loop.driver_start.TrainerStart`), the step
    (:class:`~dhp.runtime.loop.driver_step.TrainerStep`); evaluation, checkpoints and the teardown are
    its own."""

    def __init__(
        self,
        config: RunConfig,
        plan: Plan,
        *,
        ready_timeout_s: float = 60.0,
        init_timeout_s: float = 300.0,
        startup: Startup | None = None,
        owns_ray: bool | None = None,
    ) -> None:
        """Connect Ray (``cluster.ray_address``, ``$RAY_ADDRESS`` or a local one), reserve the plan's
        placement groups (PlanError if they cannot be placed in ``ready_timeout_s``), start one actor
        per rank, init every group's world and the hand-off channel concurrently, build the modules.

        ``owns_ray``: None connects Ray here; a bool says the caller already connected it
        (:func:`dhp.runtime.launch.startup.connect_ray_importing`) and whether ``close()`` shuts it down."""
        self.model_cfg, self.train_cfg = config.model, config.train
        self.modules_cfg: dict[str, ModuleConfig] = dict(config.modules)
        self.groups: dict[str, ActorGroup] = {}
        self._backprops: list[Any] = []
        self._pgs: list[Any] = []
        self._fork_nodes: NodeForkServers | None = None  # a joined cluster's per-node fork servers
        self._timeout = config.train.step_timeout_s  # every wait on the ranks (the groups' bound)
        self.faults = FaultHook("driver")  # $DHP_INJECT_FAULT (tests only)
        self.startup = (
            startup if startup is not None else Startup()
        )  # phase times (dhp.runtime.launch.startup)
        if owns_ray is None:
            self._owns_ray = connect_ray(cluster=config.cluster, plan=plan)
            self.startup.mark("Ray start")
        else:
            self._owns_ray = owns_ray
        try:
            pgs, specs = specs_from_plan(plan, cpus_per_rank=config.cluster.cpus_per_rank)
            self._pgs = reserve(pgs, timeout_s=ready_timeout_s)
            self.startup.mark("placement groups")
            preload_family(config.model.family)  # a local server started for none or another
            self._fork_nodes = start_for_cluster(self._pgs, family=config.model.family)
            names = self._wire(config, plan, specs)
            self._start_groups(config, plan, specs, names, init_timeout_s=init_timeout_s)
            self._build_modules(init_timeout_s=init_timeout_s)
        except BaseException:
            self.close(graceful=False)
            raise

    @property
    def consumer(self) -> ActorGroup:
        """The group of the module with the loss (the LLM)."""
        return self.groups[self.consumer_name]

    # ---- evaluation ------------------------------------------------------------------------
    def evaluate(self, batches: Iterable[StepData], *, stop: Callable[[], bool]) -> EvalResult | None:
        """A forward-only pass over ``batches`` on every group (``dhp.runtime.loop.eval_worker``): per eval
        micro-batch the producers' forward and the consumer's loss, routed as a step's; no gradient,
        no optimizer state, the ranks' RNG streams put back after. Returns the token-weighted loss
        (``dhp.runtime.loop.evaluation``), or None when ``stop()`` turned true between two batches (a
        signal: the pass is dropped, every call of the batches issued has finished)."""
        t0 = time.perf_counter()
        for g in self.groups.values():
            g.call(ModuleWorker.eval_begin)
        parts = EvalParts()
        leaders = self._consumer_leaders()  # one per endpoint: each holds its own tokens' loss
        stopped = False
        for data in batches:
            if stop():
                stopped = True
                break
            pending = []
            for m in range(len(data.micro_batches)):
                sent = self._produce(data, m, backward=False)  # no gradient, nothing kept
                pending.append(
                    self.consumer.submit(
                        ModuleWorker.eval_consume, data.micro_batches[m], self._inboxes(sent), micro_batch=m
                    )
                )
            for p in pending:
                parts.add(
                    self.consumer.get([p.ref(r, 0) for r in leaders], what="eval", timeout_s=self._timeout)
                )
            parts.count_batch(data)
        for g in self.groups.values():
            g.call(ModuleWorker.eval_end)
        return None if stopped else parts.result(seconds=time.perf_counter() - t0)

    # ---- whole-module views and checkpoints --------------------------------------------------
    def full_state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{module: {fqn: full fp32 CPU tensor}}`` (tiny models: verify and parity)."""
        return {n: g.call(ModuleWorker.full_state_dict) for n, g in self.groups.items()}

    def save_modules(self, root: str) -> None:
        """Every group writes ``<root>/<module>`` collectively, all groups at once (each group's
        write is bounded by ``train.step_timeout_s``, like every wait on the ranks)."""
        pend = {n: g.submit(ModuleWorker.save_checkpoint, f"{root}/{n}") for n, g in self.groups.items()}
        for n, g in self.groups.items():
            g.collect(pend[n])

    def load_modules(self, root: str) -> dict[str, bool]:
        """Every group loads ``<root>/<module>``; per module, whether rank RNG was restored."""
        pend = {n: g.submit(ModuleWorker.load_checkpoint, f"{root}/{n}") for n, g in self.groups.items()}
        return {n: g.collect(pend[n]) for n, g in self.groups.items()}

    def rank_stacks(self, *, timeout_s: float = 30.0) -> list[RankStack]:
        """Every rank's Python stacks as they are now (a hang: where each rank waits), read before
        the teardown (``dhp.runtime.actors.stacks``)."""
        return read_stacks(self.groups, timeout_s=timeout_s)

    def close(self, *, graceful: bool = True) -> None:
        """Destroy each group's world (when ``graceful``), kill the actors, release the bundles,
        and shut Ray down if this trainer started it (no orphan processes)."""

        try:
            for g in self.groups.values():
                g.shutdown(destroy_dist=graceful)
            if self._pgs:
                release(self._pgs)
        finally:
            self.groups, self._pgs = {}, []
            if self._fork_nodes is not None:  # the ranks' actors are gone: their nodes' servers go
                self._fork_nodes.close()
                self._fork_nodes = None
            if self._owns_ray and ray.is_initialized():
                ray.shutdown()
            self._owns_ray = False
