"""The driver step, reading like DESIGN.md's algorithm, across the vision and LLM actor groups.

Per micro-batch ``m`` (gradient accumulation over ``m``):

    work   = route(micro_batch m)                # driver: N:M image routing + SP cut (pure)
    enc    = vision.vision_forward(work)         # each rank puts its embedding rows once
    loss   = llm.llm_forward_backward(batch, enc)  # backprops loss_sum / T; returns d/d(embeds)
    vision.vision_backward(g_enc)

then ``norm = sqrt(sum of both groups' grad_norm_sq)``, clip, AdamW at the scheduled lr.
Nothing blocks between the calls: Ray orders them by their data dependencies. The encoder's
forward of micro-batch m+1 is issued before the LLM's work on m, so when the groups sit on
different devices they overlap (each actor runs its calls in issue order: F0 F1 B0 F2 B1 ...).
Memory on the driver: the routing tensors of one step and object refs; embeddings never pass
through the driver.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dhp.config.schema import ClusterConfig, ModuleConfig, RunConfig
from dhp.data import StepData
from dhp.errors import RuntimeFailure
from dhp.plan import Plan
from dhp.runtime.actor_group import ActorGroup, init_groups, release, reserve, specs_from_plan
from dhp.runtime.bridge import BridgeLayout
from dhp.runtime.handoff import MicroBatchRouting, route_micro_batch, unit_senders
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


class Trainer:
    """The actor groups of one run and the step across them. ``close()`` frees everything."""

    def __init__(
        self, config: RunConfig, plan: Plan, *, ready_timeout_s: float = 60.0, init_timeout_s: float = 300.0
    ) -> None:
        """Connect Ray (``cluster.ray_address``, ``$RAY_ADDRESS`` or a local one), reserve the plan's
        placement groups (PlanError if they cannot be placed in ``ready_timeout_s``), start one actor
        per rank, init every group's world concurrently, and build the modules."""
        self.model_cfg, self.train_cfg = config.model, config.train
        self.modules_cfg: dict[str, ModuleConfig] = dict(config.modules)
        self.groups: dict[str, ActorGroup] = {}
        self._vision_bwd: list[Any] = []
        self._update: list[Any] = []
        self._pgs: list[Any] = []
        self._timeout = config.train.step_timeout_s
        self._owns_ray = connect_ray(cluster=config.cluster, plan=plan)
        try:
            pgs, specs = specs_from_plan(plan, cpus_per_rank=config.cluster.cpus_per_rank)
            self._pgs = reserve(pgs, timeout_s=ready_timeout_s)
            llm_replicas = specs["llm"].layout.num_replicas
            self._vision_units = specs["vision"].layout.num_units if "vision" in specs else 0
            self.p2p = plan.handoff == "p2p" and "vision" in specs
            bridge = (
                BridgeLayout(
                    vision_world=specs["vision"].world_size,
                    llm_world=specs["llm"].world_size,
                    vision_tp=specs["vision"].layout.tp_size,
                    llm_ranks_per_replica=specs["llm"].layout.ranks_per_replica,
                )
                if self.p2p
                else None
            )
            for name, spec in specs.items():
                kwargs = {
                    "model": config.model,
                    "module": self.modules_cfg[name],
                    "train": config.train,
                    "mesh": spec.mesh,
                    "device": spec.device,
                    "handoff": plan.handoff,
                    "num_llm_replicas": llm_replicas,
                    "num_vision_units": self._vision_units,
                    "bridge_layout": bridge,
                    "loss_chunk_tokens": plan.loss_chunk_tokens.get(name, 0),  # the plan's resolved chunk
                }
                self.groups[name] = ActorGroup(
                    spec, pgs=self._pgs, worker_cls=ModuleWorker, worker_kwargs=kwargs
                )
            init_groups(list(self.groups.values()), timeout_s=init_timeout_s)
            if self.p2p:
                self._init_bridge(timeout_s=init_timeout_s)
            pending = {n: g.submit("build") for n, g in self.groups.items()}
            self.param_counts = {
                n: g.collect(pending[n], timeout_s=init_timeout_s) for n, g in self.groups.items()
            }
        except BaseException:
            self.close(graceful=False)
            raise

    def _init_bridge(self, *, timeout_s: float) -> None:
        """Every rank of both groups joins the p2p bridge (store on vision rank 0), concurrently."""
        addr, port = self.vision.master_address(avoid=set())
        backend = "nccl" if self.vision.spec.device == "cuda" else "gloo"
        kw = {"host": addr, "port": port, "backend": backend, "timeout_s": timeout_s}
        pend = [g.submit("init_bridge", **kw) for g in (self.vision, self.llm)]
        try:
            for p in pend:
                p.group.collect(p, timeout_s=timeout_s + 10)
        except RuntimeFailure as e:
            raise RuntimeFailure(
                f"p2p hand-off bridge ({backend} {addr}:{port}, vision+llm ranks) failed to start: {e}. "
                "Fix: check that the port is reachable between the groups' nodes, or use handoff=auto."
            ) from e

    @property
    def vision(self) -> ActorGroup | None:
        return self.groups.get("vision")

    @property
    def llm(self) -> ActorGroup:
        return self.groups["llm"]

    # ---- the step --------------------------------------------------------------------------
    def step(self, data: StepData, *, lr: float, collect_grads: bool = False) -> StepResult:
        """Run one optimizer step on ``data``; a non-finite loss or grad norm stops before the update."""
        t0 = time.perf_counter()
        driver_s = 0.0
        vision_grads = self.vision is not None and not self.modules_cfg["vision"].freeze
        llm_out, enc_next = [], None
        for m in range(len(data.micro_batches)):
            td = time.perf_counter()
            enc = enc_next if enc_next is not None else self._encode(data, m)
            driver_s += time.perf_counter() - td
            if m + 1 < len(data.micro_batches):
                td = time.perf_counter()
                enc_next = self._encode(data, m + 1)  # overlaps the LLM's work on m
                driver_s += time.perf_counter() - td
            else:
                enc_next = None
            llm_out.append(self._llm_forward_backward(data, m, enc, vision_grads=vision_grads))
            if vision_grads and enc is not None:
                self._vision_backward(m, llm_out[-1])
        leaders = self.llm.layout.leaders()
        stats = [
            self.llm.get(
                [_as_list(p.refs[r])[0] for r in leaders],
                what="llm_forward_backward",
                timeout_s=self._timeout,
            )
            for p in llm_out
        ]
        loss_sum = sum(s["loss_sum"] for per_m in stats for s in per_m)
        wait_s = sum(max(s["wait_s"] for s in per_m) for per_m in stats)
        loss = loss_sum / data.num_label_tokens
        norm_sq = self._finalize_grads()
        norm = math.sqrt(norm_sq) if norm_sq >= 0 else float("nan")
        if not (math.isfinite(loss) and math.isfinite(norm)):
            for g in self.groups.values():
                g.call("zero_grads")
            raise NonFiniteStep(
                f"step {data.step + 1}: non-finite {'loss' if not math.isfinite(loss) else 'grad norm'} "
                f"(loss={loss}, grad_norm={norm}); the update was not applied. Samples: "
                f"{[sid for mb in data.micro_batches for b in mb for sid in b.sample_ids]}. Fix: lower "
                "train.lr, check the data, or use fp32 (model.dtype=float32) to find the overflow."
            )
        grads = {n: g.call("full_grads") for n, g in self.groups.items()} if collect_grads else None
        clip = self.train_cfg.grad_clip
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        self._update = [g.submit("optimizer_step", lr=lr, clip_coef=coef) for g in self.groups.values()]
        self.finish_update()
        step_stats = {n: g.call("take_stats") for n, g in self.groups.items()}
        return StepResult(
            loss=loss,
            grad_norm=norm,
            num_label_tokens=data.num_label_tokens,
            step_s=time.perf_counter() - t0,
            driver_s=driver_s,
            llm_wait_s=wait_s,
            stats=step_stats,
            grads=grads,
        )

    def finish_update(self) -> bool:
        """Wait for an optimizer update already issued; True if there was one (it is now applied)."""
        pend, self._update = self._update, []
        for p in pend:
            p.group.collect(p, timeout_s=self._timeout)
        return bool(pend)

    def abort_step(self) -> None:
        """Drop a half-run step: wait for its calls, then zero grads and in-flight state everywhere."""
        for p in self._vision_bwd:
            with contextlib.suppress(RuntimeFailure):
                p.group.collect(p)
        self._vision_bwd = []
        for g in self.groups.values():
            g.call("zero_grads")

    def _encode(self, data: StepData, m: int) -> tuple[MicroBatchRouting, Any] | None:
        """Route micro-batch ``m`` and issue the encoder's forward on every vision rank (no wait)."""
        if self.vision is None:
            return None
        batches = data.micro_batches[m]
        if all(b.image_grid_thw is None for b in batches):
            return None
        layout = self.vision.layout
        world = layout.world_size
        routing = route_micro_batch(  # one unit per (data replica, SP rank); TP ranks of a unit share it
            pixel_values=[b.pixel_values for b in batches],
            image_grid_thw=[b.image_grid_thw for b in batches],
            vision_replicas=self.vision.layout.num_replicas,
            sp_size=self.vision.spec.mesh.get("sp", 1),
            arch=self.model_cfg.vision,
            pad_empty=self.vision.spec.mesh.get("fsdp", 1) > 1,  # FSDP collectives span replicas
        )
        pending = self.vision.submit(
            "vision_forward",
            [routing.vision[layout.unit_of(r)] for r in range(world)],
            [m] * world,
            [layout.unit_leader(layout.unit_of(r)) == r for r in range(world)],  # only TP rank 0 sends
            num_returns=self.llm.layout.num_replicas,
        )
        return routing, pending

    def _llm_forward_backward(self, data: StepData, m: int, enc: Any, *, vision_grads: bool) -> Any:
        """Issue the LLM's forward+backward of micro-batch ``m``; each replica gets its senders' refs."""
        n_rep = self.llm.layout.num_replicas
        chunk_refs: list[list[Any]] = [[] for _ in range(n_rep)]
        recv_from: list[list[tuple[int, Any]]] = [[] for _ in range(n_rep)]
        if enc is not None and self.p2p:  # each replica leader receives from its units' leaders
            routing, _ = enc
            for u, work in enumerate(routing.vision):
                for route in work.routes:
                    recv_from[route.llm_replica].append(
                        (self.vision.layout.unit_leader(u), route.dst.numpy())
                    )
        elif enc is not None:
            routing, pending = enc
            for j in range(n_rep):  # one entry per vision unit, read from the unit's sending rank
                chunk_refs[j] = [
                    None if s is None else _as_list(pending.refs[s])[j]
                    for s in unit_senders(routing, j, self.vision.layout)
                ]
        with_grads = vision_grads and enc is not None
        return self.llm.submit(
            "llm_forward_backward",
            data.micro_batches[m],
            chunk_refs,
            recv_from,
            micro_batch=m,
            num_label_tokens=data.num_label_tokens,
            vision_grads=with_grads,
            num_returns=1 + self._vision_units if with_grads and not self.p2p else 1,
        )

    def _vision_backward(self, m: int, llm_pending: Any) -> None:
        """Issue the encoder's backward of ``m`` with the gradient rows each vision rank needs."""
        leaders = self.llm.layout.leaders()
        layout = self.vision.layout
        world = layout.world_size
        grad_refs = [
            [] if self.p2p else [llm_pending.refs[leader][1 + layout.unit_of(r)] for leader in leaders]
            for r in range(world)
        ]
        self._vision_bwd.append(self.vision.submit("vision_backward", [m] * world, grad_refs))

    def _finalize_grads(self) -> float:
        """Wait for every backward, reduce grads in each group (concurrently), sum the squared norms."""
        for p in self._vision_bwd:
            self.vision.collect(p, timeout_s=self._timeout)
        self._vision_bwd = []
        pend = {n: g.submit("finalize_grads") for n, g in self.groups.items()}
        return sum(g.collect(pend[n], timeout_s=self._timeout) for n, g in self.groups.items())

    # ---- whole-module views and checkpoints --------------------------------------------------
    def full_state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{module: {fqn: full fp32 CPU tensor}}`` (tiny models: verify and parity)."""
        return {n: g.call("full_state_dict") for n, g in self.groups.items()}

    def save_modules(self, root: str) -> None:
        """Every group writes ``<root>/<module>`` collectively, all groups at once."""
        pend = {n: g.submit("save_checkpoint", f"{root}/{n}") for n, g in self.groups.items()}
        for n, g in self.groups.items():
            g.collect(pend[n])

    def load_modules(self, root: str) -> dict[str, bool]:
        """Every group loads ``<root>/<module>``; per module, whether rank RNG was restored."""
        pend = {n: g.submit("load_checkpoint", f"{root}/{n}") for n, g in self.groups.items()}
        return {n: g.collect(pend[n]) for n, g in self.groups.items()}

    def close(self, *, graceful: bool = True) -> None:
        """Destroy each group's world (when ``graceful``), kill the actors, release the bundles,
        and shut Ray down if this trainer started it (no orphan processes)."""
        import ray

        try:
            for g in self.groups.values():
                g.shutdown(destroy_dist=graceful)
            if self._pgs:
                release(self._pgs)
        finally:
            self.groups, self._pgs = {}, []
            if self._owns_ray and ray.is_initialized():
                ray.shutdown()
            self._owns_ray = False


def connect_ray(*, cluster: ClusterConfig, plan: Plan) -> bool:
    """Join ``cluster.ray_address`` or ``$RAY_ADDRESS`` if set, else start a local Ray sized to the
    plan's bundles. Reserves nothing: the placement groups are taken later (``reserve``).

    Returns True when this call initialised Ray in this process, so ``Trainer.close()`` calls
    ``ray.shutdown()``: that stops a local instance, but for a joined cluster it only disconnects
    this driver (the job's actors and placement groups end with it; the cluster and its other jobs
    stay up). False when Ray was already initialised (the caller's, left alone).

    Joining a cluster that uses token authentication (Ray >= 2.60 turns it on for a new local
    cluster) needs ``RAY_AUTH_MODE=token`` and the token (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``
    or ``~/.ray/auth_token``) in this process's environment: Ray switches auth on by itself only
    for a cluster it finds on its own, never for an explicit address. A join Ray refuses raises
    PlanError naming the address, where it came from, Ray's reason and the fix.
    """
    import ray

    from dhp.errors import PlanError

    if ray.is_initialized():
        return False
    term = signal.getsignal(signal.SIGTERM)  # ray.init installs Ray's own SIGTERM handler: keep ours
    # dhp reports a failed rank itself (module, rank, reason); Ray would also print the coloured
    # traceback of every failed result nobody fetched once a step is abandoned
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    if not sys.stderr.isatty():  # Ray's "(raylet) ..." lines: colour codes only on a terminal
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    address = cluster.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        source = "cluster.ray_address" if cluster.ray_address else "$RAY_ADDRESS"
        _check_reachable(address, source=source)  # Ray retries a dead address for minutes
        try:
            ray.init(address=address, log_to_driver=False)
            _keep_handler(signal.SIGTERM, term)
        except ConnectionError as e:
            lines = str(e.__cause__ or e).strip().splitlines() or [str(e)]
            reason = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1]).strip()
            raise PlanError(  # Ray's cause is a traceback; its last error line, first sentence
                f"cannot join the Ray cluster at {address!r} (from {source}): {e}: "
                f"{reason.split('. ')[0].rstrip('.')}. Fix: check the address (the head's host:port "
                "from `ray start --head`) and that the head is up; for a cluster with token "
                "authentication, set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH "
                "(default ~/.ray/auth_token) in dhp's environment."
            ) from e
        return True
    need = {}
    for pg in plan.placement_groups:
        for b in pg.bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0.0) + v
    cpus = max(1, math.ceil(need.get("CPU", 1.0) - 1e-9))
    gpus = math.ceil(need.get("GPU", 0.0) - 1e-9)
    kwargs = {"num_gpus": gpus} if gpus else {}
    # address="local": always a new instance of our own, never a `ray start` head found on this machine
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False, **kwargs)
    _keep_handler(signal.SIGTERM, term)
    from dhp.runtime.reaper import start_for_local_ray

    start_for_local_ray()  # a SIGKILLed driver's Ray processes go within seconds, not minutes
    return True


def _keep_handler(signum: int, handler: Any) -> None:
    """Put ``handler`` back for ``signum`` (main thread only; None: it was not set from Python)."""
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signum, handler)


def _check_reachable(address: str, *, source: str, timeout_s: float = 5.0) -> None:
    """PlanError at once when nothing listens at a ``host:port`` (or ``ray://host:port``) address.

    ``ray.init`` keeps retrying an address with no head behind it (over 90 s seen here); a TCP
    connect tells in ``timeout_s``. ``auto`` and addresses without a port are left to Ray.
    """
    import socket

    from dhp.errors import PlanError

    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise PlanError(
            f"no Ray cluster answers at {address!r} (from {source}): {e}. Fix: start the head "
            "(`ray start --head`) or correct the address; unset it to start a local Ray."
        ) from e


def _as_list(refs: Any) -> list[Any]:
    return refs if isinstance(refs, list) else [refs]
