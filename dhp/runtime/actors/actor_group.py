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
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dhp.errors import DhpError, PlanError, RuntimeFailure
from dhp.layout import ParallelLayout
from dhp.plan.types import bundle_total
from dhp.runtime.actors.base_worker import DistWorker, RankProcess
from dhp.runtime.actors.dispatch import collect_results, contract_of, split_args
from dhp.runtime.actors.failures import FAULT_DRIVER_ENV, FAULT_ENV, FaultHook, WorkerFailure, rank_error
from dhp.runtime.launch.forknodes import WORKER_ENV, NodeForkServers
from dhp.runtime.launch.forkserver import runtime_env_fields


@dataclass(frozen=True)
class RankSlot:
    """Where one rank's actor runs: a bundle of a reserved placement group, and what it takes from it.

    Collocated groups share a bundle: each rank takes ``num_gpus = gpu_fraction`` of the GPU and
    ``num_cpus = cpus_per_rank``.
    """

    pg_index: int
    bundle_index: int
    num_cpus: float
    num_gpus: float = 0.0


@dataclass(frozen=True)
class GroupSpec:
    """What the runtime needs from one plan group: its name, layout, rank slots and device."""

    name: str
    layout: ParallelLayout  # the plan's (GroupPlan.layout)
    slots: tuple[RankSlot, ...]
    device: str = "cpu"  # cpu | cuda (from the cluster config)

    @property
    def world_size(self) -> int:
        return len(self.slots)


def specs_from_plan(
    plan: Any, *, cpus_per_rank: float
) -> tuple[list[tuple[list[dict], str]], dict[str, GroupSpec]]:
    """The plan's placement groups (bundles, strategy) and one GroupSpec per module group."""
    pgs = [([dict(b) for b in pg.bundles], pg.strategy) for pg in plan.placement_groups]
    specs = {}
    for g in plan.groups:
        slots = tuple(
            RankSlot(
                pg_index=r.placement_group,
                bundle_index=r.bundle_index,
                num_cpus=cpus_per_rank,
                num_gpus=r.gpu_fraction if plan.device == "cuda" else 0.0,
            )
            for r in g.ranks
        )
        specs[g.name] = GroupSpec(name=g.name, layout=g.layout, slots=slots, device=plan.device)
    return pgs, specs


class CallTimeout(RuntimeFailure):
    """A call whose ranks did not all answer in time: a hang (a collective missing a peer, a deadlock)."""


@dataclass
class Pending:
    """Refs of an issued call, one per rank (a list per rank when ``num_returns > 1``)."""

    group: ActorGroup
    method: Callable[..., Any]  # the worker's function, e.g. ModuleWorker.produce
    refs: list[Any]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.method.__name__

    def ref(self, rank: int, index: int = 0) -> Any:
        """The ref of return value ``index`` of ``rank``'s call (``num_returns > 1``: one per value)."""
        refs = self.refs[rank]
        if isinstance(refs, list):
            return refs[index]
        if index:
            raise RuntimeFailure(f"{self.name}: rank {rank} returned one value, asked for value {index}")
        return refs


class ActorGroup:
    """Reserve, start and address one module's ranks. ``call`` applies each method's contract.

    A call names the worker class's own function (``group.call(ModuleWorker.zero_grads)``): the
    contract comes from its ``@register`` line, and a function of another class is refused.
    """

    def __init__(
        self,
        spec: GroupSpec,
        *,
        pgs: Sequence[Any],
        worker_cls: type,
        worker_kwargs: dict[str, Any],
        wait: bool = True,
        timeout_s: float = 900.0,
        fork_nodes: NodeForkServers | None = None,
    ) -> None:
        """Start one actor per rank in its placement-group bundle. ``wait=False`` returns at once
        (call :meth:`wait_started`), so several groups' processes start, and import torch and the
        model code, at the same time instead of one group after the other. ``timeout_s`` bounds every
        wait on the ranks that names no bound of its own (the Trainer's: its start-up bound while
        the groups start and build, ``train.step_timeout_s`` after): no wait on a rank is unbounded.
        ``fork_nodes``: a joined cluster's per-node fork servers, each rank forked from its bundle's
        node's (else from this node's server when one serves a local Ray, else the ordinary way)."""
        self.spec = spec
        self.name = spec.name
        self.layout = spec.layout
        self.worker_cls = worker_cls
        self.timeout_s = timeout_s
        self.faults: FaultHook | None = None  # the driver's $DHP_INJECT_FAULT points (tests only)
        self.procs: list[RankProcess] = []  # per rank: pid, how it began, node, stack file
        self.actors = _start_actors(spec, pgs=pgs, worker_cls=worker_cls, worker_kwargs=worker_kwargs,
                                    fork_nodes=fork_nodes)  # fmt: skip
        self._pid_refs = self._submit_raw(DistWorker.started, [((), {})] * spec.world_size)
        if wait:
            self.wait_started()

    @property
    def pids(self) -> list[int]:
        """Per rank: its actor's process id."""
        return [p.pid for p in self.procs]

    @property
    def starts(self) -> list[str]:
        """Per rank: ``forked`` | ``fresh`` | ``fresh: why the fork server could not serve``."""
        return [p.how for p in self.procs]

    def wait_started(self) -> None:
        """Block until every rank's actor answers (a rank that dies while starting is a RuntimeFailure)."""
        if not self.procs:
            self.procs = self.get(self._pid_refs, what="start")

    def master_address(self, *, avoid: set[int]) -> tuple[str, int]:
        """Rank 0's node IP and a free port not in ``avoid`` (ports already given to other groups:
        a port is free only until its store binds it, so two groups could otherwise draw the same)."""
        for _ in range(20):
            addr, port = self.get([self.actors[0].master_addr_port.remote()], what="master address")[0]
            if port not in avoid:
                return addr, port
        raise RuntimeFailure(f"group '{self.name}': no free rendezvous port distinct from {sorted(avoid)}")

    def begin_init(self, *, timeout_s: float, addr_port: tuple[str, int] | None = None) -> Pending:
        """Issue this group's torch.distributed init on all ranks (gloo on cpu, nccl on cuda); do not wait."""
        addr, port = addr_port or self.master_address(avoid=set())
        backend = "nccl" if self.spec.device == "cuda" else "gloo"
        kwargs = {"master_addr": addr, "master_port": port, "backend": backend, "timeout_s": timeout_s}
        refs = self._submit_raw(DistWorker.init_dist, [((), kwargs)] * self.spec.world_size)
        return Pending(
            group=self, method=DistWorker.init_dist, refs=refs, extra={"where": f"{backend} {addr}:{port}"}
        )

    def finish_init(self, pending: Pending, *, timeout_s: float) -> None:
        """Wait for ``begin_init``; a rank missing after ``timeout_s`` is a RuntimeFailure naming the group."""
        try:
            self.get(pending.refs, what=pending.name, timeout_s=timeout_s)
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
    def submit(self, method: Callable[..., Any], *args: Any, num_returns: int = 1, **kwargs: Any) -> Pending:
        """Issue ``method`` (a function of this group's worker class) on every rank per its dispatch
        contract; do not wait."""
        contract = contract_of(self.worker_cls, method)
        per_rank = split_args(contract, self.layout, method.__name__, args, kwargs)
        return Pending(group=self, method=method, refs=self._submit_raw(method, per_rank, num_returns))

    def collect(self, pending: Pending, *, timeout_s: float | None = None) -> Any:
        """Wait for every rank of ``pending`` (at most ``timeout_s``, the group's bound when None)
        and return what its contract collects."""
        values = self.get(pending.refs, what=pending.name, timeout_s=timeout_s)
        return collect_results(contract_of(self.worker_cls, pending.method), self.layout, values)

    def call(
        self, method: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any
    ) -> Any:
        """``submit`` then ``collect``."""
        return self.collect(self.submit(method, *args, **kwargs), timeout_s=timeout_s)

    def get(self, refs: Sequence[Any], *, what: str, timeout_s: float | None = None) -> list[Any]:
        """Wait for one result per rank; the first failed rank raises RuntimeFailure naming it, and
        a rank still running after ``timeout_s`` (the group's bound when None) raises CallTimeout.

        Results are taken as they finish (``ray.wait``), so a dead rank is reported at once even
        while its peers are still blocked in a collective waiting for it.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        flat, owner = [], {}
        for rank, ref in enumerate(refs):
            for r in ref if isinstance(ref, list) else [ref]:
                owner[r] = rank
                flat.append(r)
        deadline = time.monotonic() + timeout_s
        pending = list(flat)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                slow = sorted({owner[r] for r in pending})
                raise CallTimeout(
                    f"group '{self.name}': '{what}' did not finish in {timeout_s}s on rank(s) {slow} "
                    "(a hang: a collective missing a peer, or a deadlock)"
                )
            try:
                ray.get(ready[0])
            except ray.exceptions.RayError as e:
                failed = {owner[ready[0]]: e}
                rank, err = self._blame(owner[ready[0]], e, pending, owner, failed)
                raise self._failure(rank, err, failed) from err
        values = ray.get(flat)
        out, i = [], 0
        for ref in refs:
            n = len(ref) if isinstance(ref, list) else 1
            out.append(values[i : i + n] if isinstance(ref, list) else values[i])
            i += n
        return out

    def _blame(
        self,
        rank: int,
        err: BaseException,
        pending: list[Any],
        owner: dict[Any, int],
        failed: dict[int, BaseException],
        grace_s: float = 3.0,
    ) -> tuple[int, BaseException]:
        """The rank to blame for a failed call: a rank whose actor died beats a rank whose call
        failed (a peer's collective breaks *because* a rank died, and often reports first). Waits
        up to ``grace_s`` for the other ranks' results to tell them apart; every rank seen failing
        is added to ``failed`` (its traceback goes into the run's traceback file)."""
        died = (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError)
        if isinstance(err, died) or not pending:
            return rank, err
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s)
        dead = None
        for r in sorted(ready, key=lambda x: owner[x]):
            try:
                ray.get(r, timeout=0)
            except ray.exceptions.RayError as e:
                failed.setdefault(owner[r], e)
                if isinstance(e, died) and dead is None:
                    dead = owner[r], e
        if dead is not None:
            return dead
        for r in range(len(self.actors)):  # a dead actor whose result was not asked for here
            if r != rank and not self._answers(r):
                return r, ray.exceptions.ActorDiedError()
        return rank, err

    def _answers(self, rank: int) -> bool:
        """Whether ``rank``'s actor is alive. One that does not answer within 2 s is busy, not dead:
        its call queues behind one still running (a peer blocked in the collective the failed rank
        left), and blaming it would hide the failed rank's own error."""
        try:
            ray.get(self.actors[rank].pid.remote(), timeout=2)
        except ray.exceptions.GetTimeoutError:
            return True
        except ray.exceptions.RayError:
            return False
        return True

    def _submit_raw(
        self, method: Callable[..., Any], per_rank: list[tuple[tuple, dict]], num_returns: int = 1
    ) -> list[Any]:
        out = []
        for rank, (actor, (args, kwargs)) in enumerate(zip(self.actors, per_rank, strict=True)):
            fn = getattr(actor, method.__name__)  # the Ray actor handle's remote method of that function
            if num_returns != 1:
                fn = fn.options(num_returns=num_returns)
            out.append(fn.remote(*args, **kwargs))
            if rank == 0 and self.faults is not None and len(self.actors) > 1:
                self.faults.at(method.__name__)  # between two ranks' submissions (tests only)
        return out

    def _failure(
        self, rank: int, e: BaseException, failed: dict[int, BaseException] | None = None
    ) -> WorkerFailure:
        """A RuntimeFailure naming module, rank and pid for a failed call on ``rank``, holding the
        error and traceback of ``rank`` and of every other rank in ``failed`` (blamed rank first)."""
        failed = dict(failed or {})
        failed.pop(rank, None)
        errors = [
            rank_error(self.name, r, self._summary(r, x), x) for r, x in [(rank, e), *sorted(failed.items())]
        ]
        return WorkerFailure(self._summary(rank, e), errors=errors)

    def _summary(self, rank: int, e: BaseException) -> str:
        """One line: module, rank, pid and what happened on that rank."""
        if isinstance(e, ray.exceptions.ActorDiedError | ray.exceptions.ActorUnavailableError):
            return f"module '{self.name}' rank {rank}{self._pid_note(rank)} died: {_first_line(e)}"
        if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
            if isinstance(e.cause, DhpError):
                return f"module '{self.name}' rank {rank}: {e.cause}"
            return (
                f"module '{self.name}' rank {rank}{self._pid_note(rank)} failed: "
                f"{type(e.cause).__name__}: {_first_line(e.cause)}"
            )
        return f"module '{self.name}' rank {rank}{self._pid_note(rank)} failed: {_first_line(e)}"

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
        """Barrier and destroy the world (best effort), then kill the actors."""
        if destroy_dist:
            # a dead rank: the others' worlds die with their processes below
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get([a.destroy_dist.remote() for a in self.actors], timeout=30)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


def init_groups(groups: Sequence[ActorGroup], *, timeout_s: float) -> None:
    """Initialise every group's own world concurrently (each init blocks until its ranks join)."""
    taken: set[int] = set()
    addresses = []
    for g in groups:  # distinct ports first, then all inits at once
        addr, port = g.master_address(avoid=taken)
        taken.add(port)
        addresses.append((addr, port))
    pendings = [
        g.begin_init(timeout_s=timeout_s, addr_port=a) for g, a in zip(groups, addresses, strict=True)
    ]
    for g, p in zip(groups, pendings, strict=True):
        g.finish_init(p, timeout_s=timeout_s + 10)


def reserve(pgs: Sequence[tuple[list[dict[str, float]], str]], *, timeout_s: float) -> list[Any]:
    """Reserve placement groups ``(bundles, strategy)``; if Ray cannot place them in time, free
    what was reserved and raise PlanError naming the bundles and what the cluster has."""
    reserved = [placement_group(b, strategy=st) for b, st in pgs]
    ready, _ = ray.wait([pg.ready() for pg in reserved], num_returns=len(reserved), timeout=timeout_s)
    if len(ready) == len(reserved):
        return reserved
    release(reserved)
    need = bundle_total(b for bundles, _ in pgs for b in bundles)
    raise PlanError(
        f"cannot place the plan: placement groups {[(len(b), b[0], st) for b, st in pgs]} (total {need}) "
        f"were not reserved within {timeout_s:.0f}s; the Ray cluster has {ray.available_resources()} "
        f"available of {ray.cluster_resources()}. Fix: lower the degrees, lower cluster.cpus_per_rank, "
        "or join a larger cluster (cluster.ray_address / RAY_ADDRESS)."
    )


def release(pgs: Sequence[Any]) -> None:
    """Free reserved placement groups."""
    for pg in pgs:
        remove_placement_group(pg)


def _start_actors(
    spec: GroupSpec,
    *,
    pgs: Sequence[Any],
    worker_cls: type,
    worker_kwargs: dict[str, Any],
    fork_nodes: NodeForkServers | None,
) -> list[Any]:
    """One actor of ``worker_cls`` per rank of ``spec``, each in its slot's placement-group bundle
    (its CPUs and GPUs), forked from its node's fork server when one serves it; returns at once."""
    remote_cls = ray.remote(worker_cls)
    return [
        remote_cls.options(
            num_cpus=slot.num_cpus,
            num_gpus=slot.num_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pgs[slot.pg_index], placement_group_bundle_index=slot.bundle_index
            ),
            runtime_env=_runtime_env(fork_nodes, pgs[slot.pg_index], slot.bundle_index),
        ).remote(module_name=spec.name, rank=rank, world_size=spec.world_size, **worker_kwargs)
        for rank, slot in enumerate(spec.slots)
    ]


def _runtime_env(fork_nodes: NodeForkServers | None, pg: Any, bundle_index: int) -> dict[str, Any]:
    """A rank actor's runtime_env: the ranks' environment and how its process starts (forked from
    its node's server, or the ordinary way with the reason in its environment)."""
    launch = fork_nodes.runtime_env(pg, bundle_index) if fork_nodes is not None else runtime_env_fields()
    return {**launch, "env_vars": {**_worker_env(), **launch.get("env_vars", {})}}


def _worker_env() -> dict[str, str]:
    """WORKER_ENV, plus the test-only fault hook when the driver has it set (a worker of an already
    running Ray does not see the driver's later environment otherwise)."""
    hook = os.environ.get(FAULT_ENV)
    return {**WORKER_ENV, FAULT_ENV: hook, FAULT_DRIVER_ENV: str(os.getpid())} if hook else dict(WORKER_ENV)


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def _first_line(e: BaseException) -> str:
    """The first line of ``e``'s message without terminal colour codes (Ray colours its errors;
    the console adds its own colours only on a TTY)."""
    text = _ANSI.sub("", str(e)).strip().splitlines()
    return text[0] if text else type(e).__name__
