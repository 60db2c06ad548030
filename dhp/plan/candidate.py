"""One plan of the ``--auto`` search (``dhp.plan.search``): each module's choice, and the whole
candidate with its placement, overrides and label."""

from __future__ import annotations

from dataclasses import dataclass, field

from dhp.layout import ParallelLayout


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
    """One plan of the search: the placement (its GPU-sharing ``sets``), the micro-batch, every
    module's choice (``choices``: the producers in the graph's order, then the consumer), each
    producer's ``seq_len`` and the predicted step, peak and usable memory. ``cand.<module>`` is that
    module's choice and ``cand.<producer>_seq_len`` its seq_len (:meth:`__getattr__`)."""

    placement: str
    micro_batch: int
    seq_lens: tuple[tuple[str, int], ...]
    choices: tuple[ModuleChoice, ...]
    step_s: float
    peak: int
    budget: int
    bottleneck: str
    idle: dict[str, float] = field(default_factory=dict)
    sets: tuple[tuple[str, ...], ...] = ()

    def __getattr__(self, name: str) -> object:
        """A module's choice by the module's name; ``<producer>_seq_len``: that producer's seq_len."""
        if name.startswith("__"):
            raise AttributeError(name)
        for c in object.__getattribute__(self, "choices"):
            if c.name == name:
                return c
        for producer, seq in object.__getattribute__(self, "seq_lens"):
            if name == f"{producer}{SEQ_SUFFIX}":
                return seq
        raise AttributeError(f"{type(self).__name__} has no module or attribute {name!r}")

    @property
    def consumer(self) -> ModuleChoice:
        return self.choices[-1]

    @property
    def producers(self) -> tuple[ModuleChoice, ...]:
        return self.choices[:-1]

    def overrides(self) -> list[str]:
        out = [f"placement={self.placement}", f"train.micro_batch_size={self.micro_batch}"]
        for m in self.choices:
            out.append(f"modules.{m.name}.gpus={m.world}")
            degs = m.degrees.config_values()
            out += [f"modules.{m.name}.parallel.{k}={override_value(v)}" for k, v in degs.items() if v != []]
            out.append(f"modules.{m.name}.activation_checkpointing={m.ac}")
        out += [f"modules.{name}.seq_len={seq}" for name, seq in self.seq_lens]
        return out

    def _set_worlds(self) -> list[int]:
        world = {m.name: m.world for m in self.choices}
        return [max(world[n] for n in group) for group in self.sets]

    @property
    def gpus(self) -> int:
        """GPUs the plan uses (the modules of a sharing set share theirs)."""
        return sum(self._set_worlds())

    def label(self) -> str:
        """The candidate in one line (computed once: the search sorts by it)."""
        known = self.__dict__.get("_label")
        if known is None:
            known = self._label_text()
            object.__setattr__(self, "_label", known)
        return known

    def _label_text(self) -> str:
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

        worlds = self._set_worlds()
        split = "" if len(worlds) <= 1 else " " + ":".join(str(w) for w in worlds)
        mods = " | ".join(f"{m.name} {deg(m)}" for m in self.choices)
        return f"{self.placement}{split} | {mods} | mb {self.micro_batch}"


#: ``Candidate.<producer>_seq_len`` / ``Search.<producer>_seq_len(mb, sp)``: a producer's seq_len
SEQ_SUFFIX = "_seq_len"


def override_value(value: object) -> str:
    """A degree as a command-line override writes it (``true``, ``4``, ``[20,20]``)."""
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value).lower()
