"""The one rank layout of a module group (like torchtitan's ``ParallelDims``). Pure, torch-free.

A group's mesh has axes dp, fsdp, sp, tp (``PARALLEL_AXES``, outer -> inner; dependency-free, so
``dhp.config``, ``dhp.plan`` and ``dhp.runtime`` can all import it),
so rank ``r`` has coordinates ``r = ((dp * F + fsdp) * S + sp) * T + tp``. This module is the only
place that formula is computed: validation, the planner, the runtime's dispatch / hand-off and the
workers all ask a :class:`RankLayout`.

- a data replica = one (dp, fsdp) coordinate: its ``sp * tp`` ranks are contiguous and see the same
  batch; there are ``dp * fsdp`` replicas, and a replica's leader is its first rank;
- a unit = one (data replica, SP rank), i.e. one TP group: its ``tp`` ranks are contiguous and hold
  the same hand-off rows; its leader (TP rank 0) is the one rank that sends or receives them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PARALLEL_AXES = ("dp", "fsdp", "sp", "tp")  # mesh order, outer -> inner (re-exported by dhp.config.constants)
#: ZeRO-1 shards the optimizer state over the ranks that hold identical parameters and gradients:
#: the dp and sp axes (flattened). The planner's memory (dhp.plan.memory) and the optimizer
#: (dhp.parallel.optim) both read this one definition.
ZERO1_AXES = ("dp", "sp")


@dataclass(frozen=True)
class RankLayout:
    """Degrees of one group's mesh and every rank <-> coordinate question about it.

    The constructor does not validate (config validation reports bad degrees as issues); build it
    with :meth:`from_mesh` (the plan's ordered mesh, missing axes = 1) or :meth:`from_parallel`
    (a ``parallel`` config node or any mapping / object with the four degrees).
    """

    dp: int = 1
    fsdp: int = 1
    sp: int = 1
    tp: int = 1

    @classmethod
    def from_mesh(cls, mesh: Mapping[str, int]) -> RankLayout:
        unknown = set(mesh) - set(PARALLEL_AXES)
        if unknown:
            raise ValueError(f"mesh axes {sorted(unknown)} are not among {PARALLEL_AXES}")
        return cls(**{a: int(mesh.get(a, 1)) for a in PARALLEL_AXES})

    @classmethod
    def from_parallel(cls, parallel: Any) -> RankLayout:
        """From a ``modules.<name>.parallel`` node, a mapping with keys dp, fsdp, sp, tp, or an object
        with those attributes."""
        if isinstance(parallel, Mapping):
            return cls(**{a: int(parallel[a]) for a in PARALLEL_AXES})
        return cls(**{a: int(getattr(parallel, a)) for a in PARALLEL_AXES})

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def degrees(self) -> dict[str, int]:
        """All four axes, ordered outer -> inner."""
        return {a: getattr(self, a) for a in PARALLEL_AXES}

    def mesh(self) -> dict[str, int]:
        """The plan's ordered mesh: axes > 1, or ``{"dp": 1}`` for a single rank."""
        axes = {a: d for a, d in self.degrees.items() if d > 1}
        return axes or {"dp": 1}

    @property
    def world_size(self) -> int:
        return self.dp * self.fsdp * self.sp * self.tp

    @property
    def tp_size(self) -> int:
        return self.tp

    @property
    def ranks_per_replica(self) -> int:
        """Ranks of one data replica (sp * tp): they see the same batch."""
        return self.sp * self.tp

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas (dp * fsdp): each sees different samples."""
        return self.dp * self.fsdp

    @property
    def num_units(self) -> int:
        """Units: one per (data replica, SP rank), i.e. per TP group (the hand-off's endpoints)."""
        return self.num_replicas * self.sp

    def span(self, axis: str) -> int:
        """Consecutive ranks one ``axis`` group reaches across: its degree times the inner axes'
        (e.g. ``span("tp") = tp``, ``span("sp") = sp * tp``, ``span("dp") = world_size``)."""
        out = 1
        for a in reversed(PARALLEL_AXES):
            out *= getattr(self, a)
            if a == axis:
                return out
        raise ValueError(f"unknown axis {axis!r}; axes are {PARALLEL_AXES}")

    # ---- rank <-> coordinates ----------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of ``rank`` (all four axes, ordered)."""
        self._check_rank(rank)
        out: dict[str, int] = {}
        rest = rank
        for axis in reversed(PARALLEL_AXES):
            degree = getattr(self, axis)
            out[axis] = rest % degree
            rest //= degree
        return {a: out[a] for a in PARALLEL_AXES}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """Inverse of :meth:`coords`; a missing axis is coordinate 0."""
        rank = 0
        for axis in PARALLEL_AXES:
            degree, c = getattr(self, axis), int(coords.get(axis, 0))
            if not 0 <= c < degree:
                raise ValueError(f"coordinate {axis}={c} outside degree {degree}")
            rank = rank * degree + c
        return rank

    def replica_of(self, rank: int) -> int:
        """Data replica of ``rank`` (its (dp, fsdp) coordinate, flattened)."""
        return rank // self.ranks_per_replica

    def replica_ranks(self, replica: int) -> list[int]:
        """The sp * tp contiguous ranks of data replica ``replica``."""
        start = replica * self.ranks_per_replica
        return list(range(start, start + self.ranks_per_replica))

    def leaders(self) -> list[int]:
        """The first rank of each data replica."""
        return [r * self.ranks_per_replica for r in range(self.num_replicas)]

    def is_replica_leader(self, rank: int) -> bool:
        return rank % self.ranks_per_replica == 0

    def unit_of(self, rank: int) -> int:
        """The unit (TP group) of ``rank``: its TP ranks are contiguous, so ``rank // tp``."""
        return rank // self.tp

    def unit_leader(self, unit: int) -> int:
        """TP rank 0 of ``unit``: the one rank of it that sends or receives hand-off rows."""
        return unit * self.tp

    def unit_ranks(self, unit: int) -> list[int]:
        """The tp contiguous ranks of ``unit``."""
        return list(range(unit * self.tp, (unit + 1) * self.tp))

    def axis_groups(self, axis: str) -> list[list[int]]:
        """The ranks of every 1-D sub-group along ``axis`` (the others fixed), in rank order."""
        if axis not in PARALLEL_AXES:
            raise ValueError(f"unknown axis {axis!r}; axes are {PARALLEL_AXES}")
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            groups.setdefault(tuple(v for a, v in c.items() if a != axis), []).append(rank)
        return list(groups.values())

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
