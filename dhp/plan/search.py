"""``dhp plan --auto``: a deterministic search for the fastest plan that fits.

The search combines the run's producers (encoders, any number) with the module that computes the
loss, all read off the module graph (``dhp.plan.graph``).

Space, for the run's cluster (N = nodes x gpus_per_node GPUs):

- placement: the modules' GPU-sharing sets (``dhp.config.placement``): collocated (one set),
  disaggregated (a set per module) and, for up to ``ALL_PARTITIONS_UP_TO`` modules, every other
  partition (for more, only the producers together apart from the consumer), minus those whose
  hand-off edges would need different transports; each on all N GPUs with every split of them over
  the sets (two modules: collocated on N, disaggregated v + l = N), the same on N/2, N/4, ... GPUs,
  which win only where more ranks are predicted slower, and the run config's own placement and GPU
  counts (``Search.classes``);
- per module and world size: every (dp, fsdp, sp, tp, ZeRO-1, SP inside TP, ep, etp, expert FSDP)
  that :func:`dhp.config.plan_space.module_problems` accepts, the same rule validation and
  ``parallelize`` apply (the axes the family declares for the module, sp and tp exclusive, tp inside
  a node and dividing what the family names, ZeRO-1 only without FSDP; ep > 1, etp in {1, tp} and
  expert FSDP only for a module with MoE blocks, ep dividing dp x fsdp x sp and ep x etp the expert
  count, expert FSDP only with edp > 1);
- activation checkpointing off | selective | full per module;
- sequence parallelism inside TP (on or off, where tp > 1 and the module has it);
- micro-batch: every size that divides the global batch over the LLM replicas. Each pixel producer's
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
the consumer); a candidate is the combination, each sharing set's modules added up on its GPUs.
Combinations are visited fastest-bound first and the visit skips a consumer whose time alone
already exceeds the 10th best step (bound pruning, not sampling). With several producers each one
keeps only its ``PRODUCER_CHOICES`` fastest choices that fit alone where it shares GPUs, its fastest
one where it has GPUs of its own, before they are combined (their product stays small); with one producer every choice is combined, as before. Plans that do not fit are dropped; the best ones are then validated as full run configs
(``dhp.validation.validate``), and rejected ones dropped, until ``top`` remain. Ranking: predicted
tokens/s (the step's work is fixed by the global batch, so this is the shortest step time); ties
break on the candidate's text form, so the result is deterministic.
"""

from __future__ import annotations

import bisect
import collections
import copy
import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from dhp.config.handoff import run_handoff
from dhp.config.placement import partitions, placement_name, set_of, sets_among
from dhp.config.plan_space import (
    declared_axes,
    pipeline_micro_batches,
    split_backward_refuses,
)
from dhp.errors import PlanError
from dhp.layout import ParallelLayout, module_layout
from dhp.models.registry import get_arch
from dhp.plan.candidate import SEQ_SUFFIX, Candidate, ModuleChoice
from dhp.plan.compile import image_patches, packed_rows
from dhp.plan.estimate import (
    busy_processes,
    coefficients,
    handoff_seconds,
    pipeline_time,
    producer_patches_per_replica,
    timing_shapes,
)
from dhp.plan.graph import run_graph
from dhp.plan.memory import encoder_replica_patches, module_shape, sp_rank_tokens
from dhp.plan.params import architecture, video_frames_per_row
from dhp.plan.phases import gpu_timeline, reserve_bytes
from dhp.plan.pipeline import ahead_of_pipeline, pipeline_terms
from dhp.plan.schedule import schedule
from dhp.plan.search_space import divisors, module_degrees

GIB = 1 << 30


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


#: the best choices per producer the search combines when several producers feed the consumer
#: (ranked by their time per step alone) where it shares GPUs with other modules (memory decides
#: there); a producer alone on its GPUs keeps its fastest: the product stays small (prune, not multiply)
PRODUCER_CHOICES = 3
#: the modules up to which every partition into GPU-sharing sets is searched; beyond, only
#: collocated, disaggregated and the producers together apart from the consumer
ALL_PARTITIONS_UP_TO = 3


@dataclass(frozen=True)
class PlacementClass:
    """One class of candidates: GPU-sharing sets and the GPUs of each module (equal inside a set)."""

    placement: str
    sets: tuple[tuple[str, ...], ...]
    worlds: dict[str, int]

    def key(self) -> tuple:
        """(placement, GPUs of each module in ``modules`` order): ``Search.placements``' entries."""
        return (self.placement, *self.worlds.values())


class Search:
    """The search over one validated run config (see the module docstring)."""

    def __init__(self, config: DictConfig, fixed: set[str]) -> None:
        self.cfg = config
        self.fixed = fixed
        self.graph = run_graph(config)
        self.producers, self.consumer = self.graph.producers, self.graph.consumer
        self.modules = self.graph.modules
        self.cluster = config.cluster
        self.coef = coefficients(config.cluster)
        self.gpn = config.cluster.gpus_per_node
        self.n = config.cluster.nodes * self.gpn
        self.budget_bytes = int(config.cluster.device_memory_gib * GIB)
        self.patches_per_sample = {p: _patches_per_sample(config, p) for p in self.producers}
        self._cache: dict[tuple, ModuleChoice | None] = {}
        self._confs: dict[tuple, DictConfig] = {}  # _module_conf's
        self._given: dict[str, dict] = {}  # each module's own degrees (_keep)
        self.ruled_out: dict[str, ClassReport] = {}  # by class label, after run(): none of it fits
        self._procs = 0  # rank processes of the class being searched (every module's ranks)
        self._span = 0  # GPUs of the class being searched
        self._transport = ""  # the hand-off transport of the class being searched
        self.best_full: Candidate | None = None  # the fastest candidate seen on all N GPUs

    def __getattr__(self, name: str) -> object:
        """``<producer>_seq_len(mb, sp)``: :meth:`seq_len` of that producer."""
        if name.endswith(SEQ_SUFFIX) and name[: -len(SEQ_SUFFIX)] in self.__dict__.get("producers", ()):
            return functools.partial(self.seq_len, name[: -len(SEQ_SUFFIX)])
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    # ---- what the user fixed ------------------------------------------------------------------
    def _keep(self, name: str, world: int, d: ParallelLayout, ac: str) -> bool:
        mod = self.cfg.modules[name]
        if _fixed(self.fixed, f"modules.{name}.gpus") and world != mod.gpus:
            return False
        if name not in self._given:
            self._given[name] = module_layout(mod).config_values()
        given = self._given[name]
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
        mine = self._own().key()
        gpus = sum(max(mine[1 + self.modules.index(m)] for m in g) for g in self._own().sets)
        return out + ([gpus] if 0 < gpus <= self.n and gpus not in out else [])

    def _own(self) -> PlacementClass:
        sets = sets_among(self.cfg.placement, self.modules)
        worlds = {m: int(self.cfg.modules[m].gpus) for m in self.modules}
        return PlacementClass(str(self.cfg.placement), sets, worlds)

    def _partitions(self) -> list[tuple[tuple[str, ...], ...]]:
        """The GPU-sharing sets searched: the run config's when ``placement`` is fixed; else every
        partition of a few modules (collocated first, disaggregated last), or for more modules
        collocated, the producers together apart from the consumer, and disaggregated. Sets whose
        hand-off edges need different transports (``dhp.config.handoff.run_handoff``) are left out."""
        if _fixed(self.fixed, "placement"):
            return [self._own().sets]
        mods = self.modules
        if len(mods) <= ALL_PARTITIONS_UP_TO:
            found = partitions(mods)
        else:
            found = [(mods,), (self.producers, (self.consumer,)), tuple((m,) for m in mods)]
        return [s for s in found if self._transport_of(s)[1] is None]

    def _transport_of(self, sets: tuple[tuple[str, ...], ...]) -> tuple[str, str | None]:
        return run_handoff(
            device=self.cluster.device, sets=sets, consumer=self.consumer, handoff=self.cfg.handoff
        )

    def classes(self) -> list[PlacementClass]:
        """Every class searched: each partition of ``_partitions`` on t GPUs for every t of
        ``totals``, its sets' GPU counts every composition of t (one set: t), then the run config's
        own when it is none of these. Plans on fewer GPUs than the cluster has compete on the same
        predicted step time: they win only where more ranks are predicted slower (a CPU host whose
        cores the ranks share, or too little work per rank for the collectives it adds)."""
        out: list[PlacementClass] = []
        parts = self._partitions()
        for t in self.totals():
            for sets in parts:
                name = placement_name(sets, self.modules)
                for split in _compositions(t, len(sets)):
                    per_set = dict(zip(sets, split, strict=True))
                    worlds = {m: next(w for g, w in per_set.items() if m in g) for m in self.modules}
                    out.append(PlacementClass(name, sets, worlds))
        mine = self._own()
        return out + ([mine] if mine.key() not in {c.key() for c in out} else [])

    def placements(self) -> list[tuple]:
        """(placement, GPUs of each module: producers, then the consumer) of every class searched
        (:meth:`classes`); with one producer (placement, producer GPUs, consumer GPUs)."""
        return [c.key() for c in self.classes()]

    def micro_batches(self, l_reps: int, *p_reps: int) -> list[int]:
        """Micro-batch sizes that divide the global batch over the consumer's ``l_reps`` replicas and,
        where a producer has more replicas (``p_reps``), split over them."""
        gb = self.cfg.train.global_batch_size
        if _fixed(self.fixed, "train.micro_batch_size"):
            mbs = [self.cfg.train.micro_batch_size]
        else:
            mbs = divisors(gb)
        return [
            mb
            for mb in mbs
            if gb % (mb * l_reps) == 0 and all(v <= l_reps or mb % (v // l_reps) == 0 for v in p_reps)
        ]

    def seq_len(self, producer: str, mb: int, sp: int) -> int:
        """``modules.<producer>.seq_len`` of a candidate. A pixel producer: the patches of one
        consumer replica's micro-batch of ``mb`` samples (what the loader bounds; a replica serving
        several consumer replicas encodes that many times it: ``memory.encoder_replica_patches``), on
        whole merge units of every SP rank. The recipe's own when it is fixed, when ``mb`` is the
        recipe's, or for a producer whose seq_len counts one sample's tokens (no pixel rows: its
        tokens scale with the micro-batch by themselves)."""
        cfg = self.cfg
        arch = architecture(cfg.model).modules[producer]
        own = int(cfg.modules[producer].seq_len)
        if _fixed(self.fixed, f"modules.{producer}.seq_len") or mb == cfg.train.micro_batch_size:
            return own
        if not arch.input_row:
            return own
        unit = arch.merge * sp
        need = self.patches_per_sample[producer] * mb
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
        """One module's candidate; ``l_reps``: the consumer's data replicas (a producer replica
        serves ``l_reps / d.num_replicas`` of them per micro-batch)."""
        key = (name, world, d, ac, mb, n_mb, seq, tokens, l_reps, self._procs, self._span, self._transport)
        if key in self._cache:
            return self._cache[key]
        conf = self._module_conf(name, world, ac, seq)
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
        if shape.pixels:  # as compile.module_shapes: every patch of the consumer replicas it serves
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
        producer = name in self.producers
        tok = tokens if producer and shape.pixels else timed.tokens
        time = pipeline_time(timed, tok, self.cluster, world, procs, self.coef, n_mb=n_mb)
        if producer:  # one hand-off (and one hand-back) per micro-batch, as the estimate
            rows = tok * d.sp if shape.pixels else tok
            time["handoff_s"] = handoff_seconds(
                shape, rows, self.cluster, handoff=self._transport, span=self._span
            )
        choice = ModuleChoice(name, world, d, ac, time, terms, shape, tuple(stages))
        self._cache[key] = choice
        return choice

    def _module_conf(self, name: str, world: int, ac: str, seq: int) -> DictConfig:
        """``modules.<name>`` with a candidate's GPUs, AC mode and seq_len: read-only, made once per
        (module, GPUs, AC, seq_len), as the candidates of one class share them."""
        key = (name, world, ac, seq)
        if key not in self._confs:
            mod = copy.deepcopy(OmegaConf.to_container(self.cfg.modules[name]))
            mod.update(gpus=world, activation_checkpointing=ac, seq_len=seq)
            conf = OmegaConf.create(mod)
            OmegaConf.set_readonly(conf, True)
            self._confs[key] = conf
        return self._confs[key]

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

    def _producer_tokens(self, name: str, mb: int, l_reps: int, d: ParallelLayout, seq: int) -> float:
        """Patches one rank of a pixel producer encodes per micro-batch (0 for any other producer:
        :meth:`module` times its own tokens)."""
        arch = architecture(self.cfg.model).modules[name]
        if not arch.input_row:
            return 0.0
        bound = encoder_replica_patches(seq, producer=d, consumer=ParallelLayout(dp=l_reps))
        total = producer_patches_per_replica(
            self.cfg,
            seq_len=bound,
            micro_batch=mb,
            consumer_replicas=l_reps,
            producer_replicas=d.num_replicas,
        )
        return sp_rank_tokens(arch, total, d.sp, self._image())

    def _enter(self, cls: PlacementClass) -> None:
        """Make ``cls`` the class being searched (its processes, GPUs and hand-off transport)."""
        self._procs = sum(cls.worlds.values())
        self._span = sum(max(cls.worlds[m] for m in g) for g in cls.sets)
        self._transport = self._transport_of(cls.sets)[0]

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
            bisect.insort(best, cand, key=lambda c: (c.step_s, c.label()))
            del best[keep:]
            if len(best) >= 10:
                worst = best[9].step_s

        mine = self.own()
        if mine is not None:
            add(mine)
        for cls in self.classes():
            self._enter(cls)
            report = self.ruled_out.setdefault(_class_label(cls), ClassReport())
            for cand in self._class(cls, report, bound=lambda: worst):
                add(cand)
        self.ruled_out = {k: r for k, r in self.ruled_out.items() if not r.fits}
        if mine is not None and mine.label() not in {c.label() for c in best}:
            best.append(mine)  # slower than all ``keep`` others, and still a candidate
        return best

    def _usable(self, sharers: int) -> int:
        """Usable bytes of a GPU that ``sharers`` modules' processes share."""
        return self.budget_bytes - reserve_bytes(self.budget_bytes, processes=sharers)

    def _class(self, cls: PlacementClass, report: ClassReport, bound) -> list[Candidate]:
        """The candidates of one class that fit, noting in ``report`` why the others do not;
        ``bound()``: the step time a consumer alone must beat to be worth combining."""
        cons, prods, worlds = self.consumer, self.producers, cls.worlds
        lw = worlds[cons]
        l_opts = self._degrees(cons, lw)
        p_opts = {p: self._degrees(p, worlds[p]) for p in prods}
        empty = next((p for p in prods if not p_opts[p]), None)
        if not l_opts or empty is not None:
            report.note = f"no valid {'LLM' if not l_opts else empty} layout on {lw if not l_opts else worlds[empty]} GPUs"
            return []
        alone = len(set_of(cls.sets, cons)) == 1
        solo = self._usable(1)
        out = []
        for ld in l_opts:
            l_reps = ld.num_replicas
            for reps in itertools.product(*(sorted({d.num_replicas for d in p_opts[p]}) for p in prods)):
                if any(max(r, l_reps) % min(r, l_reps) for r in reps):
                    continue
                for mb in self.micro_batches(l_reps, *reps):
                    n_mb = self.cfg.train.global_batch_size // (mb * l_reps)
                    if ld.pp > 1 and pipeline_micro_batches(ld, n_mb) is not None:
                        continue  # the schedule cannot run this many micro-batches
                    seq_l = int(self.cfg.modules[cons].seq_len)
                    llms = [
                        self.module(cons, lw, ld, ac, mb, n_mb, seq_l, 0.0)
                        for ac in self._acs(cons)
                        if self._keep(cons, lw, ld, ac) and not split_backward_refuses(ld, ac)
                    ]
                    if alone:  # the consumer's GPUs are its own
                        for c in llms:
                            report.over(gpu_timeline([c.terms]).peak, solo)
                        llms = [c for c in llms if gpu_timeline([c.terms]).peak <= solo]
                    if not llms:
                        continue
                    if n_mb * min(c.per_mb for c in llms) > bound():
                        continue  # bound: the consumer alone is slower than the 10th best step
                    options = [
                        self._producer_options(cls, p, p_opts[p], r, mb, n_mb, l_reps)
                        for p, r in zip(prods, reps, strict=True)
                    ]
                    for combo in itertools.product(*options):
                        for lc in llms:
                            cand = self._combine(cls, mb, combo, lc, n_mb, report)
                            if cand is not None:
                                out.append(cand)
        if not report.pairs and not report.note and not report.peak:
            report.note = "no micro-batch size divides the global batch over both modules' replicas"
        return out

    def _producer_options(
        self,
        cls: PlacementClass,
        name: str,
        opts: list[ParallelLayout],
        reps: int,
        mb: int,
        n_mb: int,
        l_reps: int,
    ) -> list[tuple[int, ModuleChoice]]:
        """(seq_len, choice) of producer ``name`` with ``reps`` replicas; with several producers the
        ``PRODUCER_CHOICES`` fastest alone (per step: micro-batches and finish) among those that fit
        their GPUs alone (the sharing set's memory is checked when combined)."""
        world, out = cls.worlds[name], []
        for vd in opts:
            if vd.num_replicas != reps:
                continue
            seq = self.seq_len(name, mb, vd.sp)
            tokens = self._producer_tokens(name, mb, l_reps, vd, seq)
            for vac in self._acs(name):
                if self._keep(name, world, vd, vac):
                    out.append((seq, self.module(name, world, vd, vac, mb, n_mb, seq, tokens, l_reps)))
        if len(self.producers) <= 1:
            return out
        sharers = len(set_of(cls.sets, name))
        fit = [o for o in out if gpu_timeline([o[1].terms]).peak <= self._usable(sharers)]
        fit.sort(key=lambda o: n_mb * o[1].per_mb + o[1].time["grad_sync_s"] + o[1].time["optim_s"])
        return fit[: PRODUCER_CHOICES if sharers > 1 else 1]

    def own(self) -> Candidate | None:
        """The run config's own plan as a candidate, timed and sized as every other (None when it
        does not fit): its placement, GPU counts, degrees, AC modes, micro-batch and seq_lens."""
        cfg, cls = self.cfg, self._own()
        self._enter(cls)
        mb = int(cfg.train.micro_batch_size)
        lm = cfg.modules[self.consumer]
        ld = module_layout(lm)
        n_mb = cfg.train.global_batch_size // (mb * ld.num_replicas)
        lc = self.module(
            self.consumer, int(lm.gpus), ld, str(lm.activation_checkpointing), mb, n_mb, int(lm.seq_len), 0.0
        )
        combo = []
        for p in self.producers:
            v = cfg.modules[p]
            vd, seq = module_layout(v), int(v.seq_len)
            tokens = self._producer_tokens(p, mb, ld.num_replicas, vd, seq)
            vac = str(v.activation_checkpointing)
            combo.append((seq, self.module(p, int(v.gpus), vd, vac, mb, n_mb, seq, tokens, ld.num_replicas)))
        return self._combine(cls, mb, tuple(combo), lc, n_mb, ClassReport())

    def _combine(self, cls: PlacementClass, mb, combo, lc, n_mb, report) -> Candidate | None:
        """The candidate of the producers' ``combo`` ((seq_len, choice) each) with consumer ``lc``:
        per sharing set, its modules' timelines added on one GPU (every pipeline rank of the consumer,
        where it shares), against the usable memory of that many processes; None when a set does
        not fit."""
        # a pipelined consumer: the producers hold every micro-batch's activations (dhp.plan.pipeline)
        prods = [c for _, c in combo]
        terms = {c.name: ahead_of_pipeline(c.terms, lc.degrees, micro_batches=n_mb) for c in prods}
        l_stages = lc.stages or (lc.terms,)
        per_set = []  # (peak, usable) of each sharing set
        for group in cls.sets:
            mine = [terms[n] for n in group if n != lc.name]
            if lc.name not in group:
                peak = gpu_timeline(mine).peak
            elif mine:  # every pipeline rank's GPUs also hold the producers' ranks
                peak = max(gpu_timeline([*mine, t]).peak for t in l_stages)
            else:
                peak = gpu_timeline([lc.terms]).peak
            per_set.append((peak, self._usable(len(group))))
        peak = max(p for p, _ in per_set)
        worst = max(per_set, key=lambda pc: (pc[0] - pc[1], pc[0]))
        cap = next(c for p, c in per_set if p == peak)
        fits = all(p <= c for p, c in per_set)
        report.pairs += 1
        report.fits += 1 if fits else 0
        report.over(*worst)
        if not fits:
            return None
        per = {c.name: c.time for c in prods} | {lc.name: lc.time}
        hand = sum(c.time["handoff_s"] for c in prods)
        sch = schedule(
            cls.placement,
            per,
            graph=self.graph,
            n_mb=n_mb,
            handoff=hand,
            dispatch=self.cluster.dispatch_overhead_s,
        )
        seqs = tuple((c.name, seq) for seq, c in combo)
        return Candidate(
            cls.placement, mb, seqs, (*prods, lc), sch.step_s, peak, cap, sch.bottleneck, sch.idle_s, cls.sets
        )


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive counts, the first count smallest first."""
    if parts == 1:
        return [(total,)] if total >= 1 else []
    return [(first, *rest) for first in range(1, total) for rest in _compositions(total - first, parts - 1)]


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


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= GIB else f"{nbytes / (1 << 20):.1f} MiB"


def _class_label(cls: PlacementClass) -> str:
    worlds = [max(cls.worlds[m] for m in g) for g in cls.sets]
    if len(worlds) == 1:
        return f"{cls.placement} on {worlds[0]} GPU{'s' if worlds[0] > 1 else ''}"
    return f"{cls.placement} {':'.join(str(w) for w in worlds)}"


def reason(
    best: Candidate, runner_up: Candidate | None, *, cluster_gpus: int = 0, best_full: Candidate | None = None
) -> str:
    """One sentence on why the winner wins (and, when it leaves GPUs idle, what all of them would
    have predicted)."""
    worlds = best._set_worlds()
    if len(worlds) > 1:
        consumer = best.consumer.name
        hide = (
            "the encoder stage hides behind the LLM stage"
            if best.bottleneck == consumer
            else "the LLM stage hides behind the encoder stage"
        )
        text = f"{best.placement} {':'.join(str(w) for w in worlds)} wins: {hide}"
    else:
        every = "both modules use" if len(best.choices) == 2 else "every module uses"
        text = f"{best.placement} wins: {every} every GPU, one after the other, with no pipeline bubble"
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
