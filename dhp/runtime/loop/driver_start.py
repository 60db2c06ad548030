"""The driver's start-up: the module graph of the run (its producers, the consumer with the loss,
the links between them, the plan's routing), the actor groups started on the reserved bundles,
their worlds and the hand-off channel joined, and the modules built on every rank.

A mixin of :class:`dhp.runtime.loop.driver.Trainer`. Nothing here holds a tensor: placements are the
plan's (``dhp.runtime.actors.actor_group.specs_from_plan``), memory is the ranks' (``ModuleWorker.build``).
"""

from __future__ import annotations

from typing import Any

from dhp.config.schema import RunConfig
from dhp.errors import RuntimeFailure
from dhp.models import get_family
from dhp.plan import Plan
from dhp.runtime.actors.actor_group import ActorGroup, init_groups
from dhp.runtime.actors.spec import WorkerSpec, without_degrees
from dhp.runtime.handoff.bridge import BridgeLayout
from dhp.runtime.handoff.graph import links_of
from dhp.runtime.launch.startup import actors_phase
from dhp.runtime.loop.worker import ModuleWorker


class TrainerStart:
    """Start and build the actor groups of one run (see the module docstring)."""

    def _wire(self, config: RunConfig, plan: Plan, specs: dict[str, Any]) -> list[str]:
        """The run's module graph: the family, its transformers config, the consumer (the module
        with the loss), the links into it and the producer replicas serving each consumer replica
        (the plan's routing, nothing else); returns the module names, producers first."""
        self.family = get_family(config.model.family)
        self.hf_config = _hf_config(self.family, config.model)
        names = [n for n in self.family.module_names if n in specs]  # producers first
        self.consumer_name = names[-1]  # the module with the loss
        self.links = tuple(
            link
            for link in links_of(self.family.handoffs_for(self.hf_config))
            if link.producer in specs and link.consumer == self.consumer_name
        )
        # per producer, the replica(s) serving each consumer replica: the plan's routes of it
        self.serving = {
            link.producer: [
                r.producer_replicas
                for r in sorted(plan.routing, key=lambda r: r.consumer_replica)
                if r.producer == link.producer
            ]
            for link in self.links
        }
        return names

    def _start_groups(
        self, config: RunConfig, plan: Plan, specs: dict[str, Any], names: list[str], *, init_timeout_s: float
    ) -> None:
        """One actor per rank of every group, all started at once on the reserved bundles; then every
        group's world and the hand-off channel."""
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

    def _build_modules(self, *, init_timeout_s: float) -> None:
        """Every group builds its module at once (``ModuleWorker.build``); then every wait on the
        ranks gets the step's bound, and the consumer says its loss terms defined on a batch."""
        pending = {n: g.submit(ModuleWorker.build) for n, g in self.groups.items()}
        self.param_counts = {
            n: g.collect(pending[n], timeout_s=init_timeout_s) for n, g in self.groups.items()
        }
        for g in self.groups.values():  # every later wait on the ranks: a step's bound
            g.timeout_s = self._timeout
        # the consumer's loss terms defined on a batch (dhp.models.family.StepStatistics)
        self.batch_terms: tuple[str, ...] = self.consumer.call(ModuleWorker.batch_terms)
        self.startup.mark("build (modules, weight load, parallelism, optimizer)")

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
