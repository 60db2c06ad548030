"""The one parallel layout of a module group (like torchtitan's ``ParallelDims``). Pure, torch-free.

A :class:`ParallelLayout` holds every degree of one module: the mesh axes pp, dp, fsdp, cp, sp, tp
(``MESH_AXES``, outer -> inner), the pipeline's schedule and virtual stages per rank, the expert-parallel degree ``ep`` folded over the ranks that see
different tokens, the ZeRO stage and sequence parallelism inside TP. It is built once from the
validated config by :meth:`ParallelLayout.from_config` (the only reader of ``modules.<m>.parallel``),
carried by the compiled plan per group, shipped to every worker, and meshes are cut from it.
Every derived fact is computed here and nowhere else:

- rank ``r`` has coordinates ``r = ((((pp * D + dp) * F + fsdp) * C + cp) * S + sp) * T + tp``;
- pipeline parallelism (``pp``, the outermost axis): a pipeline stage's ranks are the
  ``stage_world = world / pp`` contiguous ranks of one pp coordinate; each stage holds its own decoder
  layers (:func:`stage_cut`), and every fact below (replicas, units, the token fold, the experts' grid)
  is one stage's, numbered as stage 0's ranks and mirrored on the others. So the hand-off's endpoints
  (units and their leaders) are first-stage ranks; the other stages' ranks of a unit are its
  ``pipeline peers`` (:meth:`ParallelLayout.pipeline_peers`). With ``pp_virtual = v > 1`` each rank
  holds ``v`` stages of the ``pp * v`` (loop order: rank-stage ``s`` holds stages ``s, s + pp, ...``);
- a data replica = one (dp, fsdp) coordinate: its ``cp * sp * tp`` ranks are contiguous and see the
  same samples; there are ``dp * fsdp`` replicas, and a replica's leader is its first rank;
- a unit = one (data replica, CP rank, SP rank), i.e. one TP group: its ``tp`` ranks are contiguous
  and hold the same tokens and hand-off rows; its leader (TP rank 0) is the one rank that sends or
  receives them (context parallelism gives each CP rank of a replica its own tokens, so its own rows);
- the token-parallel fold: the dp x fsdp x cp x sp ranks (``TOKEN_AXES``), which see different
  tokens; expert parallelism cuts them into EP groups of ``ep`` consecutive ranks, and the ``edp``
  ranks that hold the same experts (Megatron's parallel folding; :meth:`ParallelLayout.expert_grid`);
- expert TP (``etp`` = 1 or tp): with ``etp = tp`` the TP ranks of a unit also cut the experts'
  work: each routes 1/tp of the unit's tokens, and one all-to-all group holds ``ep x etp`` ranks
  (``expert_group``), each with ``E / (ep x etp)`` experts; with ``etp = 1`` every TP rank of a unit
  holds the same experts and runs them on the same tokens;
- expert FSDP (``expert_fsdp``): the experts' parameters, gradients and optimizer states are also
  sharded over their ``edp`` ranks (FSDP2 on the experts' own mesh), so a rank keeps
  ``1 / (ep x etp x edp)`` of them (``expert_param_shards``);
- ZeRO-1 shards the optimizer state over the ranks that hold identical parameters and gradients:
  the dp x cp x sp ranks (``ZERO1_AXES``) for dense parameters, the edp ranks for experts.

The constructor does not validate: ``dhp.config.plan_space`` reports bad degrees as config issues
before any derived fact is asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: the mesh axes of a group, outer -> inner (re-exported by dhp.config.constants)
MESH_AXES = ("pp", "dp", "fsdp", "cp", "sp", "tp")
PARALLEL_AXES = MESH_AXES  # the name the config layer and the strategies use for the same tuple
#: the mesh axes whose ranks see different tokens: the fold expert parallelism cuts
TOKEN_AXES = ("dp", "fsdp", "cp", "sp")
#: ZeRO-1 shards the dense optimizer state over the ranks that hold identical parameters and
#: gradients: the dp, cp and sp axes (flattened)
ZERO1_AXES = ("dp", "cp", "sp")
#: the axes of the experts' mesh, outer -> inner: ``erep`` (the tp / etp TP ranks that hold the same
#: experts), ``edp`` (the ranks of the token fold that hold the same experts), ``ep`` (one all-to-all
#: group: ep x etp ranks, each with its own experts)
EXPERT_MESH_AXES = ("erep", "edp", "ep")
#: every key of a ``modules.<m>.parallel`` config node, in the order the schema declares them
CONFIG_KEYS = (
    "dp", "fsdp", "sp", "tp", "cp", "ep", "etp", "expert_fsdp", "zero", "sequence_parallel",
    "pp", "pp_virtual", "pp_schedule", "pp_cut",
)  # fmt: skip
#: the boolean keys among them
BOOL_KEYS = ("expert_fsdp", "sequence_parallel")
#: the string keys among them, and the list ones
STR_KEYS = ("pp_schedule",)
LIST_KEYS = ("pp_cut",)
#: the pipeline schedules (``parallel.pp_schedule``), each torch.distributed.pipelining's: ``gpipe``
#: (every forward, then every backward), ``1f1b``, ``interleaved_1f1b`` (``pp_virtual`` stages per
#: rank) and ``zero_bubble`` (interleaved, the backward split into its input and weight halves)
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble")
#: the schedules that run several stages per rank (``pp_virtual >= 2``) and the ones that run one
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class ParallelLayout:
    """Every degree of one module group and every rank question about it (see the module docstring)."""

    dp: int = 1
    fsdp: int = 1
    sp: int = 1
    tp: int = 1
    cp: int = 1  # context parallelism: the module's tokens cut in 2 x cp balanced chunks (dhp.parallel.cp)
    ep: int = 1  # expert parallelism over the token-parallel fold (1: experts whole on every rank)
    etp: int = 1  # TP ranks that cut the experts' work (1 or tp; see the module docstring)
    expert_fsdp: bool = False  # the experts also sharded over their edp ranks (FSDP2)
    zero: int = 0  # 0: plain DP; 1: ZeRO-1 (optimizer states partitioned, see ZERO1_AXES)
    sequence_parallel: bool = False  # Megatron sequence parallelism inside the TP group
    pp: int = 1  # pipeline stages (rank groups) the module's decoder layers are cut over
    pp_virtual: int = 1  # stages per pipeline rank (interleaved schedules: pp x pp_virtual stages)
    pp_schedule: str = "1f1b"  # one of PP_SCHEDULES
    pp_cut: tuple[int, ...] = ()  # decoder layers per stage, set by the user; () = the balanced cut

    # ---- the builder (the one reader of the config's degrees) --------------------------------
    @classmethod
    def from_config(cls, parallel: Any) -> ParallelLayout:
        """From a ``modules.<name>.parallel`` node (or any mapping / object with its keys; missing
        ones take their defaults). Ints and bools are taken as they are; nothing is validated."""
        if isinstance(parallel, Mapping):
            unknown = set(parallel) - set(CONFIG_KEYS)
            if unknown:
                raise ValueError(f"parallel degrees {sorted(unknown)} are not among {CONFIG_KEYS}")
            get = parallel.get
        else:
            get = lambda k, d: getattr(parallel, k, d)  # noqa: E731
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = get(f.name, f.default)
            if f.name in BOOL_KEYS:
                out[f.name] = bool(value)
            elif f.name in STR_KEYS:
                out[f.name] = str(value)
            elif f.name in LIST_KEYS:
                out[f.name] = tuple(int(x) for x in (value or ()))
            else:
                out[f.name] = int(value)
        return cls(**out)

    def config_values(self) -> dict[str, int | bool | str | list[int]]:
        """The ``modules.<name>.parallel`` node that builds this layout (the inverse of :meth:`from_config`)."""
        return {k: list(getattr(self, k)) if k in LIST_KEYS else getattr(self, k) for k in CONFIG_KEYS}

    def replace(self, **degrees: Any) -> ParallelLayout:
        """This layout with some degrees changed."""
        return dataclasses.replace(self, **degrees)

    # ---- the mesh ----------------------------------------------------------------------------
    @property
    def degrees(self) -> dict[str, int]:
        """The mesh axes' degrees, ordered outer -> inner."""
        return {a: getattr(self, a) for a in MESH_AXES}

    def mesh(self) -> dict[str, int]:
        """The group's ordered mesh: axes > 1, or ``{"dp": 1}`` for a single rank."""
        axes = {a: d for a, d in self.degrees.items() if d > 1}
        return axes or {"dp": 1}

    @property
    def world_size(self) -> int:
        out = 1
        for d in self.degrees.values():
            out *= d
        return out

    def span(self, axis: str) -> int:
        """Consecutive ranks one ``axis`` group reaches across: its degree times the inner axes'
        (e.g. ``span("tp") = tp``, ``span("sp") = sp * tp``, ``span("pp") = world_size``)."""
        out = 1
        for a in reversed(MESH_AXES):
            out *= getattr(self, a)
            if a == axis:
                return out
        raise ValueError(f"unknown axis {axis!r}; axes are {MESH_AXES}")

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of ``rank`` (every axis, ordered)."""
        self._check_rank(rank)
        out: dict[str, int] = {}
        rest = rank
        for axis in reversed(MESH_AXES):
            degree = getattr(self, axis)
            out[axis] = rest % degree
            rest //= degree
        return {a: out[a] for a in MESH_AXES}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """Inverse of :meth:`coords`; a missing axis is coordinate 0."""
        rank = 0
        for axis in MESH_AXES:
            degree, c = getattr(self, axis), int(coords.get(axis, 0))
            if not 0 <= c < degree:
                raise ValueError(f"coordinate {axis}={c} outside degree {degree}")
            rank = rank * degree + c
        return rank

    def axis_groups(self, axis: str) -> list[list[int]]:
        """The ranks of every 1-D sub-group along ``axis`` (the others fixed), in rank order."""
        if axis not in MESH_AXES:
            raise ValueError(f"unknown axis {axis!r}; axes are {MESH_AXES}")
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            groups.setdefault(tuple(v for a, v in c.items() if a != axis), []).append(rank)
        return list(groups.values())

    def inner_axis(self, axes: tuple[str, ...]) -> str | None:
        """The one axis among ``axes`` with degree > 1 (None: all are 1). ValueError when several are:
        the callers ask for the ranks that share a batch, where sp and tp exclude each other."""
        live = [a for a in axes if getattr(self, a) > 1]
        if len(live) > 1:
            raise ValueError(f"axes {live} are both > 1; sp and tp exclude each other inside one module")
        return live[0] if live else None

    # ---- replicas and units ------------------------------------------------------------------
    @property
    def ranks_per_replica(self) -> int:
        """Ranks of one data replica (cp * sp * tp): they see the same samples."""
        return self.cp * self.sp * self.tp

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas (dp * fsdp): each sees different samples."""
        return self.dp * self.fsdp

    @property
    def num_units(self) -> int:
        """Units: one per (data replica, CP rank, SP rank), i.e. per TP group (the hand-off's endpoints)."""
        return self.num_replicas * self.cp * self.sp

    @property
    def units_per_replica(self) -> int:
        """Units of one data replica (cp * sp): the TP groups among which its tokens or patches are cut."""
        return self.cp * self.sp

    def replica_of(self, rank: int) -> int:
        """Data replica of ``rank`` (its (dp, fsdp) coordinate, flattened; every stage's ranks of a
        replica are the same replica: they see the same samples)."""
        return (rank % self.stage_world) // self.ranks_per_replica

    def replica_ranks(self, replica: int) -> list[int]:
        """The cp * sp * tp contiguous first-stage ranks of data replica ``replica``."""
        start = replica * self.ranks_per_replica
        return list(range(start, start + self.ranks_per_replica))

    def leaders(self) -> list[int]:
        """The first rank of each data replica."""
        return [r * self.ranks_per_replica for r in range(self.num_replicas)]

    def is_replica_leader(self, rank: int) -> bool:
        """Whether ``rank`` is a replica's first rank on the first pipeline stage."""
        return rank < self.stage_world and rank % self.ranks_per_replica == 0

    def unit_of(self, rank: int) -> int:
        """The unit (TP group) of ``rank``: its TP ranks are contiguous, so ``rank // tp`` on its
        stage (a later stage's rank belongs to the unit of its first-stage peer)."""
        return (rank % self.stage_world) // self.tp

    def unit_leader(self, unit: int) -> int:
        """TP rank 0 of ``unit`` on the first stage: the one rank of it that sends or receives hand-off
        rows."""
        return unit * self.tp

    def unit_ranks(self, unit: int) -> list[int]:
        """The tp contiguous first-stage ranks of ``unit``."""
        return list(range(unit * self.tp, (unit + 1) * self.tp))

    # ---- pipeline stages ---------------------------------------------------------------------
    @property
    def stage_world(self) -> int:
        """Ranks of one pipeline stage (every axis but pp)."""
        return self.world_size // self.pp

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all: pp x pp_virtual."""
        return self.pp * self.pp_virtual

    def stage_ranges(self, layers: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` decoder layers of every stage: the user's ``pp_cut`` (layers per stage), else
        the balanced :func:`stage_cut`. ValueError when the cut does not fit (the config rule says it
        first, ``dhp.config.plan_space``)."""
        if not self.pp_cut:
            return stage_cut(layers, self.num_stages)
        if len(self.pp_cut) != self.num_stages or min(self.pp_cut) < 1 or sum(self.pp_cut) != layers:
            raise ValueError(
                f"pp_cut {list(self.pp_cut)} is not {self.num_stages} stages of >= 1 of {layers} layers"
            )
        out, lo = [], 0
        for n in self.pp_cut:
            out.append((lo, lo + n))
            lo += n
        return out

    def pp_rank(self, rank: int) -> int:
        """The pipeline coordinate of ``rank`` (0: the first stage's ranks)."""
        return rank // self.stage_world

    def stages_of(self, rank: int) -> list[int]:
        """The stage indices ``rank`` holds, in loop order: ``pp_rank, pp_rank + pp, ...``."""
        first = self.pp_rank(rank)
        return [first + k * self.pp for k in range(self.pp_virtual)]

    def pipeline_peers(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s pipeline (its coordinate on every other axis), first stage first."""
        local = rank % self.stage_world
        return [s * self.stage_world + local for s in range(self.pp)]

    def is_first_stage(self, rank: int) -> bool:
        return self.pp_rank(rank) == 0

    def holds_last_stage(self, rank: int) -> bool:
        """Whether ``rank`` holds the last stage (the norm, lm_head and loss)."""
        return self.num_stages - 1 in self.stages_of(rank)

    # ---- the token-parallel fold and the experts' axes ----------------------------------------
    @property
    def token_ranks(self) -> int:
        """Ranks that see different tokens of the step (dp x fsdp x cp x sp): the fold EP cuts."""
        out = 1
        for a in TOKEN_AXES:
            out *= getattr(self, a)
        return out

    @property
    def edp(self) -> int:
        """Expert-data-parallel ranks: the ranks of the token fold that hold the same experts."""
        return self.token_ranks // self.ep

    @property
    def ep_span(self) -> int:
        """Consecutive GPUs one EP group reaches across (its all-to-all's link): ep x tp."""
        return self.ep * self.tp

    @property
    def expert_group(self) -> int:
        """Ranks of one all-to-all group, each holding its own ``1/(ep x etp)`` of the experts."""
        return self.ep * self.etp

    @property
    def expert_param_shards(self) -> int:
        """Parts the experts' parameters and gradients are cut into: ep x etp, times edp under expert FSDP."""
        return self.expert_group * (self.edp if self.expert_fsdp else 1)

    def expert_grid(self) -> list[list[list[int]]]:
        """The ranks of the experts' mesh ``EXPERT_MESH_AXES``, ``[tp / etp][edp][ep x etp]``.

        For each TP index ``t`` the token fold's ranks (row-major: sp fastest, then cp) are cut into EP
        groups of ``ep`` consecutive units. With ``etp = 1`` each TP index has its own groups; with
        ``etp = tp`` a group takes every TP rank of its ``ep`` units (``ep x tp`` consecutive ranks).
        First-stage ranks: stage ``s`` holds the same grid offset by ``s x stage_world``
        (:meth:`stage_expert_grids`)."""
        groups = []
        for t in range(self.tp):
            fold = [r for r in range(self.stage_world) if r % self.tp == t]
            groups.append([fold[i : i + self.ep] for i in range(0, len(fold), self.ep)])
        if self.etp == 1:
            return groups
        merged = [sorted(r for t in range(self.tp) for r in groups[t][d]) for d in range(self.edp)]
        return [merged]

    def stage_expert_grids(self) -> list[list[list[list[int]]]]:
        """:meth:`expert_grid` of every pipeline stage, ``[pp][tp / etp][edp][ep x etp]``."""
        grid = self.expert_grid()
        off = self.stage_world
        return [[[[r + s * off for r in g] for g in row] for row in grid] for s in range(self.pp)]

    # ---- the optimizer's and the sequence's shards -------------------------------------------
    @property
    def zero1_ranks(self) -> int:
        """Ranks over which ZeRO-1 partitions the dense optimizer state (dp x cp x sp)."""
        out = 1
        for a in ZERO1_AXES:
            out *= getattr(self, a)
        return out

    @property
    def optimizer_shards(self) -> int:
        """Parts the dense parameters' optimizer state is cut into (ZeRO-1 over dp x cp x sp, else 1)."""
        return self.zero1_ranks if self.zero == 1 else 1

    @property
    def expert_optimizer_shards(self) -> int:
        """Parts the experts' optimizer state is cut into beyond ep x etp: over the edp ranks under
        ZeRO-1 or expert FSDP, else 1."""
        return max(1, self.edp) if self.zero == 1 or self.expert_fsdp else 1

    @property
    def expert_state_split(self) -> int:
        """Parts a rank's expert PARAMETER shard is cut into once more for its AdamW states: edp under
        ZeRO-1 without expert FSDP; 1 under expert FSDP (the parameter shard is already 1/edp) and
        without ZeRO-1. A rank's expert states: 1/(expert_param_shards x expert_state_split)."""
        return 1 if self.expert_fsdp else self.expert_optimizer_shards

    @property
    def token_multiple(self) -> int:
        """Under context parallelism every micro-batch is right-padded to a multiple of this many tokens
        (``2 * cp`` chunks, each a multiple of tp under SP inside TP); 1 without CP."""
        return 2 * self.cp * self.seq_split if self.cp > 1 else 1

    def padded_tokens(self, seq_len: int) -> int:
        """The length a micro-batch row of ``seq_len`` tokens runs at: right-padded to a multiple of
        :attr:`token_multiple` (``seq_len`` itself without CP)."""
        return padded_length(seq_len, self.token_multiple)

    def cp_rank_tokens(self, seq_len: int) -> int:
        """Tokens of one row that each CP rank holds: the padded row's ``1/cp`` (two of its ``2 cp``
        equal chunks); ``seq_len`` without CP."""
        return self.padded_tokens(seq_len) // self.cp

    @property
    def seq_split(self) -> int:
        """Parts sequence parallelism inside TP cuts the LLM's norm/residual activations into."""
        return self.tp if self.sequence_parallel and self.tp > 1 else 1

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")


def stage_cut(layers: int, stages: int) -> list[tuple[int, int]]:
    """The balanced cut of ``layers`` decoder layers over ``stages`` pipeline stages: ``[lo, hi)`` per
    stage, every stage at least one layer. The embedding and the hand-off inputs ride on the first
    stage and the norm, lm_head and loss on the last, so when the layers do not divide evenly the extra
    layers go to the middle stages first, then to the first stage (the lm_head and loss cost more than
    the embedding lookup). ValueError when ``stages > layers``."""
    if stages < 1 or stages > layers:
        raise ValueError(f"cannot cut {layers} layers into {stages} stages (each needs >= 1 layer)")
    base, extra = divmod(layers, stages)
    sizes = [base] * stages
    order = list(range(1, stages - 1)) + ([0] if stages > 1 else []) + [stages - 1]
    for i in order[:extra]:
        sizes[i] += 1
    out, lo = [], 0
    for n in sizes:
        out.append((lo, lo + n))
        lo += n
    return out


def padded_length(seq_len: int, multiple: int) -> int:
    """``seq_len`` rounded up to a multiple of ``multiple`` (the length the CP module pads to)."""
    return -(-seq_len // multiple) * multiple


def module_layout(module: Any) -> ParallelLayout:
    """The layout of one ``modules.<name>`` config node: the one place a degree is read from the config."""
    return ParallelLayout.from_config(module.parallel)


def write_layout(module: Any, layout: ParallelLayout) -> None:
    """Set a mutable ``modules.<name>`` config node's degrees to ``layout``'s (what a config rewrite,
    the smoke shrink or a search candidate, writes back)."""
    for key, value in layout.config_values().items():
        module.parallel[key] = value
