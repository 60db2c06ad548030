"""The Plan: plain frozen dataclasses, serialised by :meth:`Plan.to_json`.

A Plan is data only (no Ray, no process groups). The runtime reads it to create placement groups
(``placement_groups``), to give each actor its (group, rank, node, GPU, bundle) and to route the
encoder's outputs to the LLM ranks (``routing``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

from dhp.layout import ParallelLayout


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank of one module holds (``dhp/plan/memory.py`` and ``phases.py`` for formulas).

    ``params``/``grads``/``optimizer`` are resident; ``activations`` are the saved activations of the
    micro-batches alive at once; ``detail`` splits one micro-batch's by component; ``work`` is each
    phase's transient by term; ``phases`` the module's own live bytes per phase (alone on a GPU).
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    detail: dict[str, int] = field(default_factory=dict)  # activations of one micro-batch
    work: dict[str, dict[str, int]] = field(default_factory=dict)  # phase -> transient term -> bytes
    phases: dict[str, int] = field(default_factory=dict)  # phase -> live bytes of this module
    peak_phase: str = ""
    bytes_per_param: dict[str, int] = field(default_factory=dict)
    loss_chunk_tokens: int = 0
    # max over phases of params + grads + optimizer + saved activations (no transients, no reserve):
    # the definition dhp.metrics.accounting measures on a running rank
    accounted_peak: int = 0
    optimizer_impl: str = ""  # AdamW's implementation (train.optimizer.impl); "" when frozen
    moe: dict = field(default_factory=dict)  # dhp.plan.experts.moe_summary (MoE modules)
    linear: dict = field(default_factory=dict)  # dhp.plan.experts.linear_summary (linear attention)

    @property
    def total(self) -> int:
        """Peak over the phases of this module alone on its GPU."""
        if self.phases:
            return max(self.phases.values())
        return self.params + self.grads + self.optimizer + self.activations

    def to_json(self) -> dict:
        out = {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "total": self.total,
            "peak_phase": self.peak_phase,
            "activation_detail": dict(self.detail),
            "transients": {k: dict(v) for k, v in self.work.items()},
            "phases": dict(self.phases),
            "bytes_per_param": dict(self.bytes_per_param),
            "accounted_peak": self.accounted_peak,
        }
        if self.loss_chunk_tokens:
            out["loss_chunk_tokens"] = self.loss_chunk_tokens
        if self.optimizer_impl:
            out["optimizer_impl"] = self.optimizer_impl
        if self.moe:
            out["moe"] = dict(self.moe)
        if self.linear:
            out["linear_attention"] = dict(self.linear)
        return out


@dataclass(frozen=True)
class RankPlan:
    """Where one rank of a group runs: node, GPU on that node, and its share of the GPU."""

    rank: int
    coords: dict[str, int]  # mesh coordinate per axis, e.g. {"dp": 0, "sp": 3}
    node: int
    gpu: int  # GPU index inside the node
    global_gpu: int  # node * gpus_per_node + gpu
    gpu_fraction: float
    placement_group: int  # index into Plan.placement_groups
    bundle_index: int  # bundle inside that placement group
    memory: MemoryEstimate

    def to_json(self) -> dict:
        out = asdict(self)
        out["memory"] = self.memory.to_json()
        return out


@dataclass(frozen=True)
class GroupPlan:
    """One module = one actor group with its own torch.distributed world and mesh, cut from its
    :class:`~dhp.layout.ParallelLayout` (every degree of the group; the runtime's workers get it)."""

    name: str
    layout: ParallelLayout
    param_count: int  # full (unsharded) parameters of the module
    ranks: tuple[RankPlan, ...]
    active_param_count: int = 0  # parameters one token passes through (MoE: top-k experts); 0: = total
    #: decoder layers per pipeline stage (``dhp.layout.stage_cut``); empty without pipeline stages
    stage_layers: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def mesh(self) -> dict[str, int]:
        """Ordered axis -> degree (dp, fsdp, sp, tp; axes > 1, at least one)."""
        return self.layout.mesh()

    @property
    def active(self) -> int:
        return self.active_param_count or self.param_count

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "world_size": self.world_size,
            "mesh": dict(self.mesh),
            "param_count": self.param_count,
            "active_param_count": self.active,
            "ranks": [r.to_json() for r in self.ranks],
            **({"pipeline": self.pipeline_json()} if self.stage_layers else {}),
        }

    def pipeline_json(self) -> dict:
        """The pipeline of a group with stages: degrees, schedule and the layers of each stage."""
        lay = self.layout
        return {"pp": lay.pp, "pp_virtual": lay.pp_virtual, "schedule": lay.pp_schedule,
                "stage_layers": list(self.stage_layers)}  # fmt: skip


@dataclass(frozen=True)
class PlacementGroupSpec:
    """One Ray placement group: the bundles of one node, reserved with ``strategy``."""

    node: int
    strategy: str
    bundles: tuple[dict[str, float], ...]
    global_gpus: tuple[int, ...]  # the planned GPU behind each bundle

    def to_json(self) -> dict:
        return {
            "node": self.node,
            "strategy": self.strategy,
            "bundles": [dict(b) for b in self.bundles],
            "global_gpus": list(self.global_gpus),
        }


@dataclass(frozen=True)
class Route:
    """Which ranks of ``producer`` feed one data-parallel replica of the consumer (the module with the
    loss; every consumer rank of the replica needs them)."""

    producer: str
    consumer_replica: int
    consumer_ranks: tuple[int, ...]
    producer_replicas: tuple[int, ...]
    producer_ranks: tuple[int, ...]

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class DeviceUsage:
    """The sum over the groups sharing one GPU, against the usable device memory."""

    global_gpu: int
    node: int
    gpu: int
    groups: tuple[str, ...]
    total: int  # peak over the phases of the step (``dhp/plan/phases.py``)
    budget: int  # device memory - reserve (per process sharing this GPU)
    peak_phase: str = ""
    peak_terms: dict[str, int] = field(default_factory=dict)  # "<module>.<term>" at the peak
    by_phase: dict[str, int] = field(default_factory=dict)
    reserve: int = 0
    #: the peak if the MoE router sent every row of its EP group to this GPU's experts (0: no MoE);
    #: the verdict does not use it (``dhp/plan/memory.py``)
    worst_case_total: int = 0

    @property
    def margin(self) -> int:
        return self.budget - self.total

    @property
    def fits(self) -> bool:
        return self.margin >= 0

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(margin=self.margin, fits=self.fits)
        return out


def bundle_total(bundles: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Resources every bundle asks for, summed per key (rounded to 1e-6: fractional CPUs/GPUs)."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            need[key] = round(need.get(key, 0.0) + value, 6)
    return need


@dataclass(frozen=True)
class Plan:
    """The compiled plan of a run: groups, Ray placement, routing and the memory verdict."""

    name: str
    placement: str  # collocated | disaggregated | a partition a+b/c (dhp.config.placement)
    device: str  # cuda | cpu
    device_memory_bytes: int
    reserve_bytes: int  # held back from device memory (CUDA context, NCCL, fragmentation)
    groups: tuple[GroupPlan, ...]
    placement_groups: tuple[PlacementGroupSpec, ...]
    routing: tuple[Route, ...]
    devices: tuple[DeviceUsage, ...]
    handoff: str = "object_store"  # resolved: object_store | cuda_ipc | p2p (dhp.config.handoff)
    estimate: dict | None = None  # step-time model (dhp.plan.timing), JSON-able
    loss_chunk_tokens: dict[str, int] = field(default_factory=dict)  # resolved per module (0 -> planner)
    # module -> kernel name of its linear-attention layers (dhp.ops.linear_attn), modules that have them
    kernels: dict[str, str] = field(default_factory=dict)
    #: what the numbers are for: batch, per-sample media and lengths, per module the bound and the timed
    #: micro-batch, tokens per step (``dhp.plan.workload``), JSON-able
    workload: dict | None = None

    @property
    def resources(self) -> dict[str, float]:
        """What all of the plan's placement groups reserve together (Ray resource -> amount)."""
        return bundle_total(b for pg in self.placement_groups for b in pg.bundles)

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    @property
    def min_margin(self) -> int:
        return min(d.margin for d in self.devices)

    @property
    def layouts(self) -> dict[str, ParallelLayout]:
        """Every group's layout by module name, in declaration order."""
        return {g.name: g.layout for g in self.groups}

    def group(self, name: str) -> GroupPlan:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def to_json(self) -> dict:
        """One JSON-able dict: the ``dhp plan --json`` document and ``runs/.../plan.json``."""
        return {
            "name": self.name,
            "placement": self.placement,
            "handoff": self.handoff,
            "device": self.device,
            "device_memory_bytes": self.device_memory_bytes,
            "reserve_bytes": self.reserve_bytes,
            "fits": self.fits,
            "min_margin_bytes": self.min_margin,
            "groups": [g.to_json() for g in self.groups],
            "bundles": [pg.to_json() for pg in self.placement_groups],
            "routing": [r.to_json() for r in self.routing],
            "devices": [d.to_json() for d in self.devices],
            "loss_chunk_tokens": dict(self.loss_chunk_tokens),
            "kernels": dict(self.kernels),
            "estimate": self.estimate,
            "workload": self.workload,
        }

    def to_json_str(self) -> str:
        return json.dumps(self.to_json(), indent=2)
