"""``dhp plan --auto``: a deterministic search for the fastest plan that fits.

The search pairs the run's one producer (an encoder) with the module that computes the loss, both
read off the module graph (``dhp.plan.graph``); a run with several producers, or none, is refused.

Space, for the run's cluster (N = nodes x gpus_per_node GPUs):

- placement: collocated on all N GPUs, or disaggregated with every split v + l = N; the same on
  N/2, N/4, ... GPUs, which win only where more ranks are predicted slower, and on the run
  config's own GPU count and split (``Search.placements``);
- per module and world size: every (dp, fsdp, sp, tp, ZeRO-1, SP inside TP, ep, etp, expert FSDP)
  that :func:`dhp.config.plan_space.module_problems` accepts, the same rule validation and
  ``parallelize`` apply (the axes the family declares for the module, sp and tp exclusive, tp inside
  a node and dividing what the family names, ZeRO-1 only without FSDP; ep > 1, etp in {1, tp} and
  expert FSDP only for a module with MoE blocks, ep dividing dp x fsdp x sp and ep x etp the expert
  count, expert FSDP only with edp > 1);
- activation checkpointing off | selective | full per module;
- sequence parallelism inside TP (on or off, where tp > 1 and the module has it);
- micro-batch: every size that divides the global batch over the LLM replicas. The encoder's
  ``seq_len`` (the patches of one LLM replica's micro-batch, what the loader bounds) scales with
  it from the patches per sample (the recipe's own at the recipe's micro-batch); an encoder
  replica serving several LLM replicas is sized and timed for all their patches, as
  ``dhp plan`` does (``memory.encoder_replica_patches``).

The run config's own plan is always a candidate when it fits (``Search.own``), timed and sized as
``dhp plan`` times and sizes it, so ``--auto`` never returns something slower. When nothing fits
and validates, the error names, per class of candidates (a placement on some GPUs), what ruled it
out (memory, with the smallest peak; no valid layout; no micro-batch), and what validation refused
among the plans that fit (``no_plan_message``).

What the user fixed on the command line (``modules.vision.parallel.sp=4``, ``placement=...``,
``train.micro_batch_size=2``, an AC mode, ...) is kept: candidates that differ there are never
generated. Precision is never searched (it changes the numerics); the recipe's stays.

Each module's terms and time are computed once per (world, degrees, AC, micro-batch, replicas of
the other module); a pair is the combination. Pairs are visited fastest-bound first and the visit
stops once a module's best time alone already exceeds the 10th best step (bound pruning, not
sampling). Plans that do not fit are dropped; the best ones are then validated as full run configs
(``dhp.validation.validate``), and rejected ones dropped, until ``top`` remain. Ranking: predicted
tokens/s (the step's work is fixed by the global batch, so this is the shortest step time); ties
break on the candidate's text form, so the result is deterministic.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from dhp.config.handoff import resolve_handoff
from dhp.config.plan_space import (
    declared_axes,
    module_problems,
    pipeline_micro_batches,
    split_backward_refuses,
)
from dhp.errors import PlanError
from dhp.layout import ParallelLayout, module_layout
from dhp.models.arch import ModuleAxes
from dhp.models.registry import get_arch
from dhp.plan.compile import image_patches, packed_rows
from dhp.plan.estimate import (
    busy_processes,
    coefficients,
    handoff_seconds,
    pipeline_time,
    timing_shapes,
    vision_patches_per_replica,
)
from dhp.plan.graph import ModuleGraph, run_graph
from dhp.plan.memory import encoder_replica_patches, module_shape, sp_rank_tokens
from dhp.plan.params import architecture, video_frames_per_row
from dhp.plan.phases import gpu_timeline, reserve_bytes
from dhp.plan.pipeline import ahead_of_pipeline, pipeline_terms
from dhp.plan.schedule import schedule

GIB = 1 << 30


@dataclass(frozen=True)
class ModuleChoice:
    """One module's candidate: its layout, AC, and the estimate alone."""

    name: str
    world: int
    degrees: ParallelLayout
    ac: str
    time: dict[str, float]  # dhp.plan.estimate.module_time (+ handoff_s of the producer)
    terms: object  # phases.ModuleTerms (with pipeline stages: the fullest pipeline rank's)
    shape: object = None  # memory.ModuleShape
    stages: tuple = ()  # phases.ModuleTerms of every pipeline rank (one without pipeline stages)

    @property
    def per_mb(self) -> float:
        return self.time["fwd_s"] + self.time["bwd_s"]


@dataclass(frozen=True)
class Candidate:
    placement: str
    micro_batch: int
    vision_seq_len: int
    vision: ModuleChoice
    llm: ModuleChoice
    step_s: float
    peak: int
    budget: int
    bottleneck: str
    idle: dict[str, float] = field(default_factory=dict)

    def overrides(self) -> list[str]:
        out = [f"placement={self.placement}", f"train.micro_batch_size={self.micro_batch}"]
        for m in (self.vision, self.llm):
            out.append(f"modules.{m.name}.gpus={m.world}")
            degs = m.degrees.config_values()
            out += [f"modules.{m.name}.parallel.{k}={_override_value(v)}" for k, v in degs.items() if v != []]
            out.append(f"modules.{m.name}.activation_checkpointing={m.ac}")
        out.append(f"modules.{self.vision.name}.seq_len={self.vision_seq_len}")
        return out

    @property
    def gpus(self) -> int:
        """GPUs the plan uses (collocated modules share theirs)."""
        w = (self.vision.world, self.llm.world)
        return max(w) if self.placement == "collocated" else sum(w)

    def label(self) -> str:
        def deg(m: ModuleChoice) -> str:
            d = m.degrees
            axes = " ".join(
                f"{k}{getattr(d, k)}"
                for k in ("pp", "dp", "fsdp", "cp", "sp", "tp", "ep")
                if getattr(d, k) > 1
            )
            if d.pp > 1:  # the schedule (and its stages per rank)
                axes += f" {d.pp_schedule}" + (f" v{d.pp_virtual}" if d.pp_virtual > 1 else "")
            seq = "+sp" if m.degrees.sequence_parallel else ""
            experts = (f" etp{d.etp}" if d.etp > 1 else "") + (" efsdp" if d.expert_fsdp else "")
            return f"{axes or 'dp1'}{seq}{experts}{' z1' if m.degrees.zero else ''} ac={m.ac}"

        split = "" if self.placement == "collocated" else f" {self.vision.world}:{self.llm.world}"
        mods = f"{self.vision.name} {deg(self.vision)} | {self.llm.name} {deg(self.llm)}"
        return f"{self.placement}{split} | {mods} | mb {self.micro_batch}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def module_degrees(
    name: str, world: int, *, axes: ModuleAxes, gpus_per_node: int, mixed_precision: str
) -> list[ParallelLayout]:
    """Every (pp, pp_virtual, pp_schedule, dp, fsdp, cp, sp, tp, zero, sequence_parallel, ep, etp,
    expert_fsdp) of module ``name`` on ``world`` GPUs that the plan-validity rule
    (:func:`dhp.config.plan_space.module_problems`) accepts: the runtime's space (cp > 1 only where the
    module declares context parallelism; ep > 1, etp = tp and expert_fsdp only where it declares
    expert parallelism, ep dividing the token ranks dp x fsdp x cp x sp, ep x etp the experts,
    expert_fsdp with edp > 1; pipeline stages only where it declares pp, :func:`_pipelines`). The
    step's micro-batch count is checked per candidate (``pipeline_micro_batches``)."""
    out = []
    for pp, v, sched in _pipelines(world, axes=axes):
        out += [
            d.replace(pp=pp, pp_virtual=v, pp_schedule=sched) for d in _stage_degrees(world, pp, axes=axes)
        ]
    return [
        d
        for d in out
        if not module_problems(
            name,
            gpus=world,
            layout=d,
            axes=axes,
            gpus_per_node=gpus_per_node,
            activation_checkpointing="off",
            mixed_precision=mixed_precision,
        )
    ]


#: the pipelines the search tries where the module declares pp: (pp_virtual, schedule); gpipe is left
#: out (1f1b's bubble with more micro-batches in flight)
PIPELINE_CHOICES = ((1, "1f1b"), (2, "interleaved_1f1b"), (2, "zero_bubble"))
PIPELINE_DEGREES = (2, 4, 8)


def _pipelines(world: int, *, axes: ModuleAxes) -> list[tuple[int, int, str]]:
    """(pp, pp_virtual, schedule) of the search: no pipeline, then pp in PIPELINE_DEGREES dividing
    ``world`` with every PIPELINE_CHOICES entry, where the module declares pp (the rule checks the
    rest: stages <= layers, no cp / sequence parallelism, the refused settings)."""
    out = [(1, 1, "1f1b")]
    if axes.pp and not axes.pp_refused:
        out += [(pp, v, s) for pp in PIPELINE_DEGREES if world % pp == 0 for v, s in PIPELINE_CHOICES]
    return out


def _stage_degrees(world: int, pp: int, *, axes: ModuleAxes) -> list[ParallelLayout]:
    """The degrees of one pipeline stage's ``world / pp`` ranks (every axis but pp)."""
    world //= pp
    out = []
    for tp, sp, cp, fsdp in _splits(world, cp=axes.cp and pp == 1):
        dp = world // (tp * sp * cp * fsdp)
        eps = _divisors(dp * fsdp * cp * sp) if axes.experts else [1]
        etps = sorted({1, tp}) if axes.experts else [1]
        efsdps = (False, True) if axes.experts else (False,)
        for z, q, ep, etp, efsdp in itertools.product((0, 1), (False, True), eps, etps, efsdps):
            d = ParallelLayout(
                dp=dp, fsdp=fsdp, cp=cp, sp=sp, tp=tp, ep=ep, etp=etp, expert_fsdp=efsdp, zero=z,
                sequence_parallel=q,
            )  # fmt: skip
            if (z and dp * cp * sp == 1) or (q and (tp == 1 or pp > 1)):
                continue  # ZeRO-1 over one rank, SP inside TP of one rank (or refused by pp): a no-op
            out.append(d)
    return out


def _splits(world: int, *, cp: bool) -> list[tuple[int, int, int, int]]:
    """(tp, sp, cp, fsdp) whose product divides ``world`` (dp takes the rest); cp = 1 unless the
    module declares context parallelism."""
    out = []
    for tp in _divisors(world):
        for sp in _divisors(world // tp):
            for c in _divisors(world // (tp * sp)) if cp else [1]:
                out += [(tp, sp, c, f) for f in _divisors(world // (tp * sp * c))]
    return out


def _fixed(fixed: set[str], key: str) -> bool:
    return key in fixed


def _patches_per_sample(config: DictConfig, producer: str) -> float:
    """Patches of one sample, which candidates' ``modules.<producer>.seq_len`` scale with: synthetic
    data's images and videos, else the recipe's bound per sample (its seq_len over its micro-batch)."""
    if config.data.kind == "synthetic":
        syn = config.data.synthetic
        video = syn.videos_per_sample * (syn.video_frames // video_frames_per_row(config.model)) * syn.patches
        return float(syn.patches * syn.images_per_sample + video)
    return config.modules[producer].seq_len / config.train.micro_batch_size


class Search:
    """The search over one validated run config (see the module docstring)."""

    def __init__(self, config: DictConfig, fixed: set[str]) -> None:
        self.cfg = config
        self.fixed = fixed
        self.graph = run_graph(config)
        if len(self.graph.producers) != 1:
            raise PlanError(_one_producer(self.graph))
        self.producer, self.consumer = self.graph.producers[0], self.graph.consumer
        self.cluster = config.cluster
        self.coef = coefficients(config.cluster)
        self.gpn = config.cluster.gpus_per_node
        self.n = config.cluster.nodes * self.gpn
        self.budget_bytes = int(config.cluster.device_memory_gib * GIB)
        self.patches_per_sample = _patches_per_sample(config, self.producer)
        self._cache: dict[tuple, ModuleChoice | None] = {}
        self.ruled_out: dict[str, ClassReport] = {}  # by class label, after run(): none of it fits
        self._procs = 0
        self._placement = "collocated"
        self.best_full: Candidate | None = None  # the fastest candidate seen on all N GPUs

    # ---- what the user fixed ------------------------------------------------------------------
    def _keep(self, name: str, world: int, d: ParallelLayout, ac: str) -> bool:
        mod = self.cfg.modules[name]
        if _fixed(self.fixed, f"modules.{name}.gpus") and world != mod.gpus:
            return False
        given = module_layout(mod).config_values()
        for k, v in d.config_values().items():
            if _fixed(self.fixed, f"modules.{name}.parallel.{k}") and v != given[k]:
                return False
        return not (
            _fixed(self.fixed, f"modules.{name}.activation_checkpointing")
            and ac != mod.activation_checkpointing
        )

    def _acs(self, name: str) -> list[str]:
        mod = self.cfg.modules[name]
        if _fixed(self.fixed, f"modules.{name}.activation_checkpointing"):
            return [str(mod.activation_checkpointing)]
        return ["off", "selective", "full"]

    def totals(self) -> list[int]:
        """GPU counts a plan may use: the cluster's N, then N/2, N/4, ..., and the run config's own
        count when it is none of these (see ``placements``)."""
        out, t = [self.n], self.n
        while t % 2 == 0 and t > 1:
            t //= 2
            out.append(t)
        mine = self._own_gpus()
        return out + ([mine] if 0 < mine <= self.n and mine not in out else [])

    def _own_gpus(self) -> int:
        v, lm = int(self.cfg.modules[self.producer].gpus), int(self.cfg.modules[self.consumer].gpus)
        return max(v, lm) if self.cfg.placement == "collocated" else v + lm

    def placements(self) -> list[tuple[str, int, int]]:
        """(placement, producer GPUs, consumer GPUs): collocated on t GPUs, or disaggregated with every split
        of t, for every t of ``totals``. Plans on fewer GPUs than the cluster has compete on the same
        predicted step time: they win only where more ranks are predicted slower (a CPU host whose
        cores the ranks share, or too little work per rank for the collectives it adds)."""
        colloc = not _fixed(self.fixed, "placement") or self.cfg.placement == "collocated"
        disagg = not _fixed(self.fixed, "placement") or self.cfg.placement == "disaggregated"
        out = []
        for t in self.totals():
            out += [("collocated", t, t)] if colloc else []
            out += [("disaggregated", v, t - v) for v in range(1, t)] if disagg else []
        mods = self.cfg.modules
        mine = (str(self.cfg.placement), int(mods[self.producer].gpus), int(mods[self.consumer].gpus))
        return out + ([mine] if mine not in out else [])

    def micro_batches(self, l_reps: int, v_reps: int) -> list[int]:
        gb = self.cfg.train.global_batch_size
        if _fixed(self.fixed, "train.micro_batch_size"):
            mbs = [self.cfg.train.micro_batch_size]
        else:
            mbs = _divisors(gb)
        return [
            mb for mb in mbs if gb % (mb * l_reps) == 0 and (v_reps <= l_reps or mb % (v_reps // l_reps) == 0)
        ]

    def vision_seq_len(self, mb: int, sp: int) -> int:
        """``modules.<producer>.seq_len`` of a candidate: the patches of one LLM replica's micro-batch of
        ``mb`` samples (what the loader bounds; an encoder replica serving several LLM replicas
        encodes that many times it: ``memory.encoder_replica_patches``), on whole merge units of
        every SP rank. The recipe's own when it is fixed, or when ``mb`` is the recipe's."""
        cfg = self.cfg
        if _fixed(self.fixed, f"modules.{self.producer}.seq_len") or mb == cfg.train.micro_batch_size:
            return int(cfg.modules[self.producer].seq_len)
        unit = architecture(cfg.model).modules[self.producer].merge * sp
        need = self.patches_per_sample * mb
        return int(math.ceil(need / unit) * unit)

    # ---- one module ---------------------------------------------------------------------------
    def module(
        self,
        name: str,
        world: int,
        d: ParallelLayout,
        ac: str,
        mb: int,
        n_mb: int,
        seq: int,
        tokens: float,
        l_reps: int = 1,
    ) -> ModuleChoice | None:
        """One module's candidate; ``l_reps``: the LLM's data replicas (an encoder replica serves
        ``l_reps / d.num_replicas`` of them per micro-batch)."""
        key = (name, world, d, ac, mb, n_mb, seq, tokens, l_reps, self._procs, self._placement)
        if key in self._cache:
            return self._cache[key]
        mod = copy.deepcopy(OmegaConf.to_container(self.cfg.modules[name]))
        mod.update(gpus=world, activation_checkpointing=ac, seq_len=seq)
        conf = OmegaConf.create(mod)
        shape = module_shape(
            name,
            model=self.cfg.model,
            module=conf,
            layout=d,
            micro_batch=mb,
            image_patches=self._image(),
            device=self.cluster.device,
        )
        if name == self.consumer:  # as compile.module_shapes: packed rows when packing is on
            shape = packed_rows(self.cfg, shape)
        if shape.pixels:  # as compile.module_shapes: every patch of the LLM replicas it serves
            replicas = ParallelLayout(dp=l_reps)
            shape = dataclasses.replace(
                shape, seq_len=encoder_replica_patches(seq, producer=d, consumer=replicas)
            )
        stages = pipeline_terms(shape, micro_batches=n_mb, optimizer_impl=self.cfg.train.optimizer.impl)
        terms = max(stages, key=lambda t: gpu_timeline([t]).peak)  # the fullest pipeline rank alone
        procs = busy_processes(max(self._procs, world))
        # time on the data's measured lengths, as the winner's estimate line does; memory (terms) keeps
        # the seq_len-filled shape
        timed = timing_shapes(self.cfg, {name: shape}, micro_batch=mb)[name]
        producer = name == self.producer
        time = pipeline_time(
            timed, tokens if producer else timed.tokens, self.cluster, world, procs, self.coef, n_mb=n_mb
        )
        if producer:  # one hand-off (and one hand-back) per micro-batch, as the estimate
            span = world if self._placement == "collocated" else self._procs
            time["handoff_s"] = handoff_seconds(
                shape, tokens * d.sp, self.cluster, handoff=self._handoff(), span=span
            )
        choice = ModuleChoice(name, world, d, ac, time, terms, shape, tuple(stages))
        self._cache[key] = choice
        return choice

    def _handoff(self) -> str:
        """The hand-off the runtime resolves for this device and the placement being searched."""
        resolved, _ = resolve_handoff(
            device=self.cluster.device, placement=self._placement, handoff=self.cfg.handoff
        )
        return resolved

    def _degrees(self, name: str, world: int) -> list[ParallelLayout]:
        return module_degrees(
            name,
            world,
            axes=declared_axes(get_arch(self.cfg.model.family), name, self.cfg.model),
            gpus_per_node=self.gpn,
            mixed_precision=self.cfg.modules[name].mixed_precision,
        )

    def _image(self) -> int:
        return image_patches(self.cfg)  # the estimate's span of one image or video

    def _vision_tokens(self, mb: int, l_reps: int, d: ParallelLayout, seq: int) -> float:
        bound = encoder_replica_patches(seq, producer=d, consumer=ParallelLayout(dp=l_reps))
        total = vision_patches_per_replica(
            self.cfg, seq_len=bound, micro_batch=mb, llm_replicas=l_reps, vision_replicas=d.num_replicas
        )
        return sp_rank_tokens(architecture(self.cfg.model).modules[self.producer], total, d.sp, self._image())

    # ---- the search ---------------------------------------------------------------------------
    def run(self, keep: int = 200) -> list[Candidate]:
        """Candidates that fit, fastest first (at most ``keep``, and the run config's own plan when it
        fits, :meth:`own`, last if slower than all of them), before full validation. Why each class
        of candidates (a placement on some GPUs) gave none that fits is left in :attr:`ruled_out`."""
        best: list[Candidate] = []
        labels: set[str] = set()
        self.ruled_out = {}
        worst = math.inf

        def add(cand: Candidate) -> None:
            nonlocal worst
            if cand.label() in labels:
                return
            labels.add(cand.label())
            if cand.gpus == self.n and (self.best_full is None or cand.step_s < self.best_full.step_s):
                self.best_full = cand
            best.append(cand)
            best.sort(key=lambda c: (c.step_s, c.label()))
            del best[keep:]
            if len(best) >= 10:
                worst = best[9].step_s

        mine = self.own()
        if mine is not None:
            add(mine)
        for placement, vw, lw in self.placements():
            self._procs, self._placement = vw + lw, placement
            report = self.ruled_out.setdefault(_class_label(placement, vw, lw), ClassReport())
            for cand in self._class(placement, vw, lw, report, bound=lambda: worst):
                add(cand)
        self.ruled_out = {k: r for k, r in self.ruled_out.items() if not r.fits}
        if mine is not None and mine.label() not in {c.label() for c in best}:
            best.append(mine)  # slower than all ``keep`` others, and still a candidate
        return best

    def _budgets(self, placement: str) -> tuple[int, int]:
        """(usable bytes of a GPU the placement shares, of a GPU one module has alone)."""
        procs = 2 if placement == "collocated" else 1
        budget = self.budget_bytes - reserve_bytes(self.budget_bytes, processes=procs)
        return budget, self.budget_bytes - reserve_bytes(self.budget_bytes, processes=1)

    def _class(self, placement: str, vw: int, lw: int, report: ClassReport, bound) -> list[Candidate]:
        """The candidates of one placement on (vw, lw) GPUs that fit, noting in ``report`` why the
        others do not; ``bound()``: the step time an LLM alone must beat to be worth pairing."""
        budget, solo = self._budgets(placement)
        cons, prod = self.consumer, self.producer
        l_opts, v_opts = self._degrees(cons, lw), self._degrees(prod, vw)
        if not l_opts or not v_opts:
            report.note = (
                f"no valid {'LLM' if not l_opts else prod} layout on {lw if not l_opts else vw} GPUs"
            )
            return []
        out = []
        for ld in l_opts:
            for v_reps in sorted({d.num_replicas for d in v_opts}):
                if max(v_reps, ld.num_replicas) % min(v_reps, ld.num_replicas):
                    continue
                for mb in self.micro_batches(ld.num_replicas, v_reps):
                    n_mb = self.cfg.train.global_batch_size // (mb * ld.num_replicas)
                    if ld.pp > 1 and pipeline_micro_batches(ld, n_mb) is not None:
                        continue  # the schedule cannot run this many micro-batches
                    seq_l = int(self.cfg.modules[cons].seq_len)
                    llms = [
                        self.module(cons, lw, ld, ac, mb, n_mb, seq_l, 0.0)
                        for ac in self._acs(cons)
                        if self._keep(cons, lw, ld, ac) and not split_backward_refuses(ld, ac)
                    ]
                    if placement != "collocated":  # the LLM's GPUs are its own
                        for c in llms:
                            report.over(gpu_timeline([c.terms]).peak, solo)
                        llms = [c for c in llms if gpu_timeline([c.terms]).peak <= solo]
                    if not llms:
                        continue
                    if n_mb * min(c.per_mb for c in llms) > bound():
                        continue  # bound: the LLM alone is slower than the 10th best step
                    for vd in v_opts:
                        if vd.num_replicas != v_reps:
                            continue
                        seq = self.vision_seq_len(mb, vd.sp)
                        tokens = self._vision_tokens(mb, ld.num_replicas, vd, seq)
                        for vac in self._acs(prod):
                            if not self._keep(prod, vw, vd, vac):
                                continue
                            vc = self.module(prod, vw, vd, vac, mb, n_mb, seq, tokens, ld.num_replicas)
                            for lc in llms:
                                cand = self._pair(placement, mb, seq, vc, lc, n_mb, budget, solo, report)
                                if cand is not None:
                                    out.append(cand)
        if not report.pairs and not report.note and not report.peak:
            report.note = "no micro-batch size divides the global batch over both modules' replicas"
        return out

    def own(self) -> Candidate | None:
        """The run config's own plan as a candidate, timed and sized as every other (None when it
        does not fit): its placement, GPU counts, degrees, AC modes, micro-batch and vision seq_len."""
        cfg = self.cfg
        v, lm = cfg.modules[self.producer], cfg.modules[self.consumer]
        vd, ld = module_layout(v), module_layout(lm)
        placement, mb = str(cfg.placement), int(cfg.train.micro_batch_size)
        self._procs, self._placement = int(v.gpus) + int(lm.gpus), placement
        n_mb = cfg.train.global_batch_size // (mb * ld.num_replicas)
        seq = int(v.seq_len)
        lc = self.module(
            self.consumer, int(lm.gpus), ld, str(lm.activation_checkpointing), mb, n_mb, int(lm.seq_len), 0.0
        )
        tokens = self._vision_tokens(mb, ld.num_replicas, vd, seq)
        vac = str(v.activation_checkpointing)
        vc = self.module(self.producer, int(v.gpus), vd, vac, mb, n_mb, seq, tokens, ld.num_replicas)
        budget, solo = self._budgets(placement)
        return self._pair(placement, mb, seq, vc, lc, n_mb, budget, solo, ClassReport())

    def _pair(self, placement, mb, seq, vc, lc, n_mb, budget, solo, report) -> Candidate | None:
        # a pipelined LLM: the encoder holds every micro-batch's activations (dhp.plan.pipeline)
        v_terms = ahead_of_pipeline(vc.terms, lc.degrees, micro_batches=n_mb)
        l_stages = lc.stages or (lc.terms,)
        if placement == "collocated":  # every pipeline rank's GPUs also hold an encoder rank
            peak, cap = max(gpu_timeline([v_terms, t]).peak for t in l_stages), budget
        else:
            peak = max(gpu_timeline([v_terms]).peak, gpu_timeline([lc.terms]).peak)
            cap = solo
        report.pairs += 1
        report.fits += 1 if peak <= cap else 0
        report.over(peak, cap)
        if peak > cap:
            return None
        per = {vc.name: vc.time, lc.name: lc.time}
        hand = vc.time["handoff_s"]
        sch = schedule(
            placement,
            per,
            graph=self.graph,
            n_mb=n_mb,
            handoff=hand,
            dispatch=self.cluster.dispatch_overhead_s,
        )
        return Candidate(placement, mb, seq, vc, lc, sch.step_s, peak, cap, sch.bottleneck, sch.idle_s)


@dataclass
class ClassReport:
    """What one class of candidates (a placement on some GPUs) gave: pairs evaluated, pairs that
    fit, and the smallest peak against the usable memory (what ruled the class out when none fit)."""

    pairs: int = 0
    fits: int = 0
    peak: int = 0  # the smallest peak seen (bytes)
    cap: int = 0
    note: str = ""

    def over(self, peak: int, cap: int) -> None:
        """Note a peak above ``cap`` (the smallest one is kept)."""
        if peak > cap and (not self.peak or peak < self.peak):
            self.peak, self.cap = peak, cap

    def why(self) -> str:
        if self.note:
            return self.note
        return f"none fits memory (smallest peak {_size(self.peak)} > {_size(self.cap)} usable)"


def _one_producer(graph: ModuleGraph) -> str:
    """Why ``--auto`` cannot search ``graph``: it pairs one producer with the loss module."""
    return (
        f"dhp plan --auto searches one encoder feeding the loss module ({graph.consumer}); this run has "
        f"{len(graph.producers)} ({', '.join(graph.producers) or 'none'}). Fix: use a VLM recipe, or plan "
        "it as configured (dhp plan without --auto)"
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= GIB else f"{nbytes / (1 << 20):.1f} MiB"


def _class_label(placement: str, vw: int, lw: int) -> str:
    gpus = f"{vw} GPU{'s' if vw > 1 else ''}"
    return f"collocated on {gpus}" if placement == "collocated" else f"disaggregated {vw}:{lw}"


def reason(
    best: Candidate, runner_up: Candidate | None, *, cluster_gpus: int = 0, best_full: Candidate | None = None
) -> str:
    """One sentence on why the winner wins (and, when it leaves GPUs idle, what all of them would
    have predicted)."""
    if best.placement == "disaggregated":
        hide = (
            "the encoder stage hides behind the LLM stage"
            if best.bottleneck == best.llm.name
            else "the LLM stage hides behind the encoder stage"
        )
        text = f"disaggregated {best.vision.world}:{best.llm.world} wins: {hide}"
    else:
        text = "collocated wins: both modules use every GPU, one after the other, with no pipeline bubble"
    if runner_up is not None:
        text += f"; {100 * (runner_up.step_s / best.step_s - 1):.1f}% faster than '{runner_up.label()}'"
    if cluster_gpus and best.gpus < cluster_gpus:
        text += f"; it uses {best.gpus} of the {cluster_gpus} GPUs: " + (
            f"the fastest plan on all of them, '{best_full.label()}', is predicted "
            f"{100 * (best_full.step_s / best.step_s - 1):.1f}% slower"
            if best_full is not None
            else "every plan on all of them is predicted slower than these"
        )
    return text


def _override_value(value: object) -> str:
    """A degree as a command-line override writes it (``true``, ``4``, ``[20,20]``)."""
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value).lower()


def apply(config: DictConfig, overrides: list[str]) -> DictConfig:
    """A read-only copy of ``config`` with ``key=value`` overrides applied (ints as ints, ``[a,b]`` as a
    list of ints)."""
    out = copy.deepcopy(config)
    OmegaConf.set_readonly(out, False)
    for item in overrides:
        key, _, value = item.partition("=")
        typed: object = {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)
        if value.startswith("[") and value.endswith("]"):
            typed = [int(v) for v in value[1:-1].split(",") if v.strip()]
        OmegaConf.update(out, key, typed)
    OmegaConf.set_readonly(out, True)
    return out


def no_plan_message(search: Search, refused: collections.Counter[str]) -> str:
    """Why ``--auto`` found nothing: per class of candidates the constraint that ruled it out
    (memory, with the smallest peak; no valid layout; no micro-batch), and what validation refused
    among the ones that fit, most frequent first."""
    lines = [f"{label}: {r.why()}" for label, r in search.ruled_out.items()]
    shown = lines[:8] + ([f"... and {len(lines) - 8} more classes"] if len(lines) > 8 else [])
    text = "dhp plan --auto found no plan that fits and validates on this cluster"
    if shown:
        text += ". Ruled out by class: " + "; ".join(shown)
    if refused:
        worst = "; ".join(f"{why} ({n}x)" for why, n in refused.most_common(3))
        text += f". Plans that fit but validation refused: {worst}"
    fix = (
        "change the refused setting above"
        if refused
        else "a larger cluster profile or shorter modules.*.seq_len"
    )
    return text + f". Fix: {fix}"


def auto_plan(
    config: DictConfig, fixed: set[str], *, top: int = 10, worst_case: bool = False
) -> tuple[list[tuple[Candidate, list[str]]], str]:
    """The ``top`` fastest valid plans that fit, each with the overrides that produce it, and one
    sentence on why the first wins. ``worst_case`` (``dhp plan --worst-case``): a candidate's
    missing run inputs (``model.path``, the data) refuse it no more than they refused the config."""
    from dhp.validation.validate import is_missing_input, validate

    search = Search(config, fixed)
    out = []
    refused: collections.Counter[str] = collections.Counter()
    for cand in search.run():
        ov = cand.overrides()
        problems = [p for p in validate(apply(config, ov)) if not (worst_case and is_missing_input(p))]
        if problems:
            refused[f"{problems[0].path}: {problems[0].rule}"] += 1
            continue
        out.append((cand, ov))
        if len(out) == top:
            break
    if not out:
        raise PlanError(no_plan_message(search, refused))
    runner_up = out[1][0] if len(out) > 1 else None
    return out, reason(out[0][0], runner_up, cluster_gpus=search.n, best_full=search.best_full)
