"""The driver step, reading like the algorithm in docs/ARCHITECTURE.md, over the family's module graph.

The graph: producer groups (e.g. the vision encoder) feed the consumer group (the module with the
loss, e.g. the LLM) over links (``dhp.runtime.graph``: every edge of one producer -> consumer,
moved as one payload). Per micro-batch ``m`` (gradient accumulation over ``m``):

    work    = route(micro_batch m)                    # driver: Plan.routing + the family's SP cut (pure)
    sent    = producer.produce(work)                  # each unit puts its rows once, per consumer replica
    grads   = consumer.consume(batch, sent)           # backprops loss_sum / T; returns d/d(rows) per unit
    producer.backprop(grads)

then ``norm = sqrt(sum of every group's grad_norm_sq)``, clip, AdamW at the scheduled lr.

Nothing blocks between the calls: Ray orders them by their data dependencies. The producers'
forward of micro-batch m+1 is issued before the consumer's work on m, so when the groups sit on
different devices they overlap (each actor runs its calls in issue order: F0 F1 B0 F2 B1 ...).
The payloads are the channel's (``dhp.runtime.transport``: object store, CUDA IPC or the bridge,
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

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from dhp.config.schema import ModuleConfig, RunConfig
from dhp.data import StepData
from dhp.errors import RuntimeFailure
from dhp.models import get_family
from dhp.ops.context import row_parts
from dhp.plan import Plan
from dhp.runtime.actor_group import ActorGroup, init_groups, release, reserve, specs_from_plan
from dhp.runtime.bridge import BridgeLayout
from dhp.runtime.evaluation import EvalParts, EvalResult
from dhp.runtime.failures import FaultHook
from dhp.runtime.forknodes import NodeForkServers, start_for_cluster
from dhp.runtime.forkserver import preload_family
from dhp.runtime.graph import links_of
from dhp.runtime.handoff import route_micro_batch, unit_senders
from dhp.runtime.spec import WorkerSpec, without_degrees
from dhp.runtime.stacks import RankStack, read_stacks
from dhp.runtime.startup import Startup, actors_phase, connect_ray
from dhp.runtime.worker import ModuleWorker


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
    llm_wait_s: float  # LLM ranks waiting for embeddings (max over replica leaders, summed over m)
    stats: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # per module, per rank
    grads: dict[str, dict[str, torch.Tensor]] | None = None
    # unweighted auxiliary losses of the loss module (an MoE router's), label-token-weighted over the step
    aux_losses: dict[str, float] = field(default_factory=dict)


class Trainer:
    """The actor groups of one run and the step across them. ``close()`` frees everything."""

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
        (:func:`dhp.runtime.startup.connect_ray_importing`) and whether ``close()`` shuts it down."""
        self.model_cfg, self.train_cfg = config.model, config.train
        self.modules_cfg: dict[str, ModuleConfig] = dict(config.modules)
        self.groups: dict[str, ActorGroup] = {}
        self._backprops: list[Any] = []
        self._pgs: list[Any] = []
        self._fork_nodes: NodeForkServers | None = None  # a joined cluster's per-node fork servers
        self._timeout = config.train.step_timeout_s  # every wait on the ranks (the groups' bound)
        self.faults = FaultHook("driver")  # $DHP_INJECT_FAULT (tests only)
        self.startup = startup if startup is not None else Startup()  # phase times (dhp.runtime.startup)
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
            self.family = get_family(config.model.family)
            self.hf_config = _hf_config(self.family, config.model)
            names = [n for n in self.family.module_names if n in specs]  # producers first
            self.consumer_name = names[-1]  # the module with the loss
            self.links = tuple(
                link
                for link in links_of(self.family.handoffs_for(self.hf_config))
                if link.producer in specs and link.consumer == self.consumer_name
            )
            # producer replica(s) serving each consumer replica: the plan's routing, nothing else
            self.serving = [r.vision_replicas for r in sorted(plan.routing, key=lambda r: r.llm_replica)]
            bridge = BridgeLayout(
                groups=tuple(
                    (n, specs[n].world_size, _endpoint_stride(n, specs, self.consumer_name)) for n in names
                )
            )
            for name in names:
                spec = WorkerSpec(
                    model=config.model,
                    module=without_degrees(self.modules_cfg[name]),
                    train=config.train,
                    layout=specs[name].layout,
                    device=specs[name].device,
                    handoff=plan.handoff,
                    links=self.links,
                    bridge_layout=bridge,
                    loss_chunk_tokens=plan.loss_chunk_tokens.get(name, 0),  # the plan's resolved chunk
                )
                self.groups[name] = ActorGroup(
                    specs[name],
                    pgs=self._pgs,
                    worker_cls=ModuleWorker,
                    worker_kwargs={"spec": spec},
                    wait=False,
                    timeout_s=init_timeout_s,  # the start-up's bound; the step's once built
                    fork_nodes=self._fork_nodes,
                )
                self.groups[name].faults = self.faults
            for group in self.groups.values():  # every group's processes start at once
                group.wait_started()
            self.startup.mark(actors_phase([h for g in self.groups.values() for h in g.starts]))
            init_groups(list(self.groups.values()), timeout_s=init_timeout_s)
            if self.links:
                self._connect_channel(names, timeout_s=init_timeout_s)
            self.startup.mark("process groups + hand-off channel")
            pending = {n: g.submit(ModuleWorker.build) for n, g in self.groups.items()}
            self.param_counts = {
                n: g.collect(pending[n], timeout_s=init_timeout_s) for n, g in self.groups.items()
            }
            for g in self.groups.values():  # every later wait on the ranks: a step's bound
                g.timeout_s = self._timeout
            # the consumer's loss terms defined on a batch (dhp.models.family.StepStatistics)
            self.batch_terms: tuple[str, ...] = self.consumer.call(ModuleWorker.batch_terms)
            self.startup.mark("build (modules, weight load, parallelism, optimizer)")
        except BaseException:
            self.close(graceful=False)
            raise

    def _connect_channel(self, names: list[str], *, timeout_s: float) -> None:
        """Every rank of every group joins the hand-off channel (rendezvous on the first group's rank 0)."""
        first = self.groups[names[0]]
        addr, port = first.master_address(avoid=set())
        backend = "nccl" if first.spec.device == "cuda" else "gloo"
        kw = {"host": addr, "port": port, "backend": backend, "timeout_s": timeout_s}
        pend = [g.submit(ModuleWorker.connect_channel, **kw) for g in self.groups.values()]
        try:
            for p in pend:
                p.group.collect(p, timeout_s=timeout_s + 10)
        except RuntimeFailure as e:
            raise RuntimeFailure(
                f"the hand-off channel ({backend} {addr}:{port}, groups {names}) failed to start: {e}. "
                "Fix: check that the port is reachable between the groups' nodes, or use handoff=auto."
            ) from e

    @property
    def consumer(self) -> ActorGroup:
        """The group of the module with the loss (the LLM)."""
        return self.groups[self.consumer_name]

    @property
    def llm(self) -> ActorGroup:
        return self.consumer

    # ---- the step --------------------------------------------------------------------------
    def step(self, data: StepData, *, lr: float, collect_grads: bool = False) -> StepResult:
        """Run one optimizer step on ``data``; a non-finite loss or grad norm stops before the update."""
        t0 = time.perf_counter()
        driver_s = 0.0
        micro_batches = len(data.micro_batches)
        td = time.perf_counter()
        whole_step = self._statistics_pass(data)  # the batch terms over the step (several micro-batches)
        driver_s += time.perf_counter() - td
        sent: list[dict[str, Any] | None] = [None] * micro_batches
        consumed = []
        for m in range(micro_batches):
            td = time.perf_counter()
            if sent[m] is None:
                sent[m] = self._produce(data, m)
            if m + 1 < micro_batches:
                sent[m + 1] = self._produce(data, m + 1)  # overlaps the consumer's work on m
            driver_s += time.perf_counter() - td
            consumed.append(self._consume(data, m, sent[m], step_statistics=whole_step))
            self._backprop(m, sent[m], consumed[-1])
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
            llm_wait_s=wait_s,
            stats=step_stats,
            grads=grads,
            aux_losses=_aux_losses(stats, data.num_label_tokens),
        )

    def _statistics_pass(self, data: StepData) -> bool:
        """Issue the step-statistics pass (module docstring) when the step needs it; whether it did.

        Needed when the consumer has loss terms defined on a batch, ``train.router_aux_loss`` is ``step``
        and a replica's batch is cut into several micro-batches (one micro-batch: its forward already
        sees the step's tokens). Per micro-batch: each producer's forward without gradient, then the
        consumer's ``statistics_pass``; no wait (the actors run them before the step's own calls)."""
        if len(data.micro_batches) < 2 or not self.batch_terms or self.train_cfg.router_aux_loss != "step":
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

        Returns ``{producer: (routing, pending)}`` for the producers with work (none without images)."""
        batches = data.micro_batches[m]
        if all(b.image_grid_thw is None for b in batches):
            return {}
        out = {}
        consumer = self.consumer.layout
        split = None  # context parallelism: each CP rank of a consumer replica takes its own tokens' rows
        if consumer.cp > 1:
            split = [
                row_parts(b.mm_token_type_ids != 0, cp=consumer.cp, multiple=consumer.token_multiple)
                for b in batches
            ]
        for link in self.links:
            group = self.groups[link.producer]
            layout, world = group.layout, group.layout.world_size
            sp = layout.sp
            routing = route_micro_batch(  # one unit per (data replica, SP rank); TP ranks of a unit share it
                pixel_values=[b.pixel_values for b in batches],
                image_grid_thw=[b.image_grid_thw for b in batches],
                serving=self.serving,
                producer_replicas=layout.num_replicas,
                sp_size=sp,
                shard_fn=lambda pv, g, n, name=link.producer: self.family.shard_inputs(
                    name, self.hf_config, pixel_values=pv, image_grid_thw=g, sp_size=n
                ),
                tokens_per_image=lambda g: self.family.tokens_per_image(self.hf_config, g),
                # FSDP collectives span replicas: a replica without images runs a blank one
                blank=self.family.blank_image(self.hf_config) if layout.fsdp > 1 else None,
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

    # ---- evaluation ------------------------------------------------------------------------
    def evaluate(self, batches: Iterable[StepData], *, stop: Callable[[], bool]) -> EvalResult | None:
        """A forward-only pass over ``batches`` on every group (``dhp.runtime.eval_worker``): per eval
        micro-batch the producers' forward and the consumer's loss, routed as a step's; no gradient,
        no optimizer state, the ranks' RNG streams put back after. Returns the token-weighted loss
        (``dhp.runtime.evaluation``), or None when ``stop()`` turned true between two batches (a
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
        the teardown (``dhp.runtime.stacks``)."""
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


def _hf_config(family: Any, model: Any) -> Any:
    """The transformers config the workers build from (edge widths, the family's SP cut)."""
    if model.path is None:
        return family.hf_config(model)
    return family.hf_config_from_dir(model.path, attn_implementation=model.attn_implementation)


def _endpoint_stride(name: str, specs: dict[str, Any], consumer: str) -> int:
    """Ranks between two hand-off endpoints of group ``name``: the endpoints of producers and of the
    consumer alike are units (TP groups); a consumer has one per data replica (sp = 1), or one per
    (replica, CP rank) under context parallelism."""
    layout = specs[name].layout
    if name == consumer and layout.sp > 1:
        raise RuntimeFailure(
            f"the hand-off's consumer {name!r} has sp={layout.sp}: its endpoints would be cut"
        )
    return layout.tp


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
