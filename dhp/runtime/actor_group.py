"""One SPMD actor group: a placement group, one Ray actor per rank, one torch.distributed world.

Placement: the group's planned bundles are reserved as one Ray placement group (fractional GPUs
when collocated, CPU-only bundles on CPU); actor ``r`` is pinned to bundle ``r``. Each group owns
a separate default torch.distributed world (gloo on cpu, nccl on cuda) on its own TCP port, so two
groups never share a communicator. Memory: the actors hold the module shards; the driver holds
only object refs.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dhp.errors import DhpError, PlanError, RuntimeFailure
from dhp.runtime.dispatch import RankLayout, collect_results, contract_of, split_args

WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class GroupSpec:
    """What the runtime needs from one plan group: its name, mesh, bundles and device."""

    name: str
    mesh: dict[str, int]  # ordered axis -> degree (dp, fsdp, sp, tp)
    bundles: list[dict[str, float]]  # one Ray bundle per rank, e.g. {"CPU": 0.5} or {"GPU": 0.5, "CPU": 1}
    strategy: str = "PACK"
    device: str = "cpu"  # cpu | cuda (from the cluster config)

    @property
    def world_size(self) -> int:
        return len(self.bundles)

    @property
    def layout(self) -> RankLayout:
        return RankLayout.from_mesh(self.mesh)


@dataclass
class Pending:
    """Refs of an issued call, one per rank (a list per rank when ``num_returns > 1``)."""

    group: ActorGroup
    method: str
    refs: list[Any]
    extra: dict[str, Any] = field(default_factory=dict)


class ActorGroup:
    """Reserve, start and address one module's ranks. ``call`` applies each method's contract."""

    def __init__(
        self,
        spec: GroupSpec,
        *,
        worker_cls: type,
        worker_kwargs: dict[str, Any],
        ready_timeout_s: float = 60.0,
        init_timeout_s: float = 120.0,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.layout = spec.layout
        self.worker_cls = worker_cls
        self.init_timeout_s = init_timeout_s
        self.pids: list[int] = []
        self._pg = _reserve(spec, timeout_s=ready_timeout_s)
        remote_cls = ray.remote(worker_cls)
        self.actors = [
            remote_cls.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": WORKER_ENV},
                name=None,
            ).remote(module_name=spec.name, rank=rank, world_size=spec.world_size, **worker_kwargs)
            for rank, bundle in enumerate(spec.bundles)
        ]
        self.pids = self.get(self._submit_raw("pid", [((), {})] * spec.world_size), what="start")

    def begin_init(self, *, timeout_s: float) -> Pending:
        """Issue this group's torch.distributed init on all ranks (gloo on cpu, nccl on cuda); do not wait."""
        addr, port = self.get([self.actors[0].master_addr_port.remote()], what="master address")[0]
        backend = "nccl" if self.spec.device == "cuda" else "gloo"
        kwargs = {"master_addr": addr, "master_port": port, "backend": backend, "timeout_s": timeout_s}
        refs = self._submit_raw("init_dist", [((), kwargs)] * self.spec.world_size)
        return Pending(group=self, method="init_dist", refs=refs, extra={"where": f"{backend} {addr}:{port}"})

    def finish_init(self, pending: Pending, *, timeout_s: float) -> None:
        """Wait for ``begin_init``; a rank missing after ``timeout_s`` is a RuntimeFailure naming the group."""
        try:
            self.get(pending.refs, what="init_dist", timeout_s=timeout_s)
        except RuntimeFailure as e:
            raise RuntimeFailure(
                f"group '{self.name}': torch.distributed init ({pending.extra['where']}, "
                f"{self.spec.world_size} ranks) failed: {e}. Fix: check that every rank started and "
                "that the port is reachable between the group's nodes."
            ) from e

    def init_process_group(self, *, timeout_s: float) -> None:
        """``begin_init`` then ``finish_init`` (one group)."""
        self.finish_init(self.begin_init(timeout_s=timeout_s), timeout_s=timeout_s)

    # ---- calls -------------------------------------------------------------------------------
    def submit(self, method: str, *args: Any, num_returns: int = 1, **kwargs: Any) -> Pending:
        """Issue ``method`` on every rank per its dispatch contract; do not wait."""
        contract = contract_of(self.worker_cls, method)
        per_rank = split_args(contract, self.layout, method, args, kwargs)
        return Pending(group=self, method=method, refs=self._submit_raw(method, per_rank, num_returns))

    def collect(self, pending: Pending, *, timeout_s: float | None = None) -> Any:
        """Wait for every rank of ``pending`` and return what its contract collects."""
        values = self.get(pending.refs, what=pending.method, timeout_s=timeout_s)
        return collect_results(contract_of(self.worker_cls, pending.method), self.layout, values)

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """``submit`` then ``collect``."""
        return self.collect(self.submit(method, *args, **kwargs), timeout_s=timeout_s)

    def get(self, refs: Sequence[Any], *, what: str, timeout_s: float | None = None) -> list[Any]:
        """Wait for one result per rank; the first failed rank raises RuntimeFailure naming it.

        Results are taken as they finish (``ray.wait``), so a dead rank is reported at once even
        while its peers are still blocked in a collective waiting for it.
        """
        flat, owner = [], {}
        for rank, ref in enumerate(refs):
            for r in ref if isinstance(ref, list) else [ref]:
                owner[r] = rank
                flat.append(r)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(flat)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                slow = sorted({owner[r] for r in pending})
                raise RuntimeFailure(
                    f"group '{self.name}': '{what}' did not finish in {timeout_s}s on rank(s) {slow} "
                    "(a hang: a collective missing a peer, or a deadlock)"
                )
            try:
                ray.get(ready[0])
            except ray.exceptions.RayError as e:
                raise self._failure(owner[ready[0]], e) from e
        values = ray.get(flat)
        out, i = [], 0
        for ref in refs:
            n = len(ref) if isinstance(ref, list) else 1
            out.append(values[i : i + n] if isinstance(ref, list) else values[i])
            i += n
        return out

    def _submit_raw(self, method: str, per_rank: list[tuple[tuple, dict]], num_returns: int = 1) -> list[Any]:
        out = []
        for actor, (args, kwargs) in zip(self.actors, per_rank, strict=True):
            fn = getattr(actor, method)
            if num_returns != 1:
                fn = fn.options(num_returns=num_returns)
            out.append(fn.remote(*args, **kwargs))
        return out

    def _failure(self, rank: int, e: BaseException) -> RuntimeFailure:
        """A RuntimeFailure naming module, rank and pid for a failed call on ``rank``."""
        if isinstance(e, ray.exceptions.ActorDiedError | ray.exceptions.ActorUnavailableError):
            return RuntimeFailure(
                f"module '{self.name}' rank {rank}{self._pid_note(rank)} died: {_first_line(e)}"
            )
        if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
            if isinstance(e.cause, DhpError):
                return RuntimeFailure(f"module '{self.name}' rank {rank}: {e.cause}")
            return RuntimeFailure(
                f"module '{self.name}' rank {rank}{self._pid_note(rank)} failed: "
                f"{type(e.cause).__name__}: {_first_line(e.cause)}"
            )
        return RuntimeFailure(
            f"module '{self.name}' rank {rank}{self._pid_note(rank)} failed: {_first_line(e)}"
        )

    def _pid_note(self, rank: int) -> str:
        return f" (pid {self.pids[rank]})" if rank < len(self.pids) else ""

    def alive(self) -> list[bool]:
        """Per rank, whether its actor answers a no-op within 5 s."""
        out = []
        for actor in self.actors:
            try:
                ray.get(actor.pid.remote(), timeout=5)
                out.append(True)
            except ray.exceptions.RayError:
                out.append(False)
        return out

    def shutdown(self, *, destroy_dist: bool = True) -> None:
        """Barrier and destroy the world (best effort), kill the actors, free the bundles."""
        if destroy_dist:
            # a dead rank: the others' worlds die with their processes below
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get([a.destroy_dist.remote() for a in self.actors], timeout=30)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self._pg)


def init_groups(groups: Sequence[ActorGroup], *, timeout_s: float) -> None:
    """Initialise every group's own world concurrently (each init blocks until its ranks join)."""
    pendings = [g.begin_init(timeout_s=timeout_s) for g in groups]
    for g, p in zip(groups, pendings, strict=True):
        g.finish_init(p, timeout_s=timeout_s + 10)


def _reserve(spec: GroupSpec, *, timeout_s: float) -> Any:
    """Reserve the group's bundles; if Ray cannot place them in time, raise PlanError naming what is missing."""
    pg = placement_group(spec.bundles, strategy=spec.strategy, name=f"dhp-{spec.name}-{os.getpid()}")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        remove_placement_group(pg)
        need: dict[str, float] = {}
        for b in spec.bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0.0) + v
        raise PlanError(
            f"group '{spec.name}': cannot reserve {spec.world_size} bundles {spec.bundles} "
            f"(strategy {spec.strategy}, total {need}) within {timeout_s:.0f}s; the Ray cluster has "
            f"{ray.available_resources()} available of {ray.cluster_resources()}. Fix: lower the "
            "module's degrees, set cluster.cpus_per_rank lower, or join a larger cluster (RAY_ADDRESS)."
        ) from e
    return pg


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
