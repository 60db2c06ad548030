"""Memory by phase: what each module's rank holds in each phase of a step, and the peak per GPU.

One step, per micro-batch, runs these phases in order (``dhp/runtime/driver.py``), then finishes:

    vision_fwd, handoff, llm_fwd, llm_bwd, handback, vision_bwd  (x micro-batches)
    grad_sync, grad_norm, optimizer

In each phase a module's rank holds:

- params and optimizer states: always;
- grads: from its first backward to the optimizer step; in every phase when the step has more than
  one micro-batch (accumulation keeps them from the previous micro-batch);
- saved activations: the encoder from its forward to its backward, for TWO micro-batches when the
  step has more than one (the driver issues the encoder's forward of m+1 before its backward of m,
  collocated or disaggregated); the LLM during its forward and backward only;
- the transient of the phase it runs (``dhp/plan/memory.py``): one block's working set, all-to-all
  buffers, FSDP's gathered blocks, the loss chunk, the hand-off payload, the flat all-reduce buffer,
  the grad-norm squares, AdamW's temporaries.

Collocated modules are two processes on one GPU: their live sets add up phase by phase on one
timeline. The GPU's peak is the max over phases (transients of different phases never add). The
usable memory is the device minus a reserve per PROCESS (CUDA context, NCCL buffers) and an
allocator-fragmentation fraction of the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dhp.plan.memory import (
    ModuleShape,
    activations_of,
    block_work_bytes,
    eager_block_bytes,
    model_states,
)

PHASES = (
    "vision_fwd",
    "handoff",
    "llm_fwd",
    "llm_bwd",
    "handback",
    "vision_bwd",
    "grad_sync",
    "grad_norm",
    "optimizer",
)
# Reserve per process: CUDA context + NCCL/gloo communicator buffers.
RESERVE_PER_PROCESS_BYTES = 1 << 30
# Allocator fragmentation, a fraction of the device (caching allocator's rounding and splits).
RESERVE_FRACTION = 0.05


def reserve_bytes(device_memory_bytes: int, processes: int = 1) -> int:
    """Bytes of a device the plan never counts as usable: per-process fixed + fragmentation."""
    return processes * RESERVE_PER_PROCESS_BYTES + int(RESERVE_FRACTION * device_memory_bytes)


@dataclass(frozen=True)
class ModuleTerms:
    """Every memory term of one rank of one module (bytes); the phase each lives in is in PHASES."""

    name: str
    params: int
    grads: int
    optimizer: int
    saved: dict[str, int]  # saved activations of ONE micro-batch, by component
    live_micro_batches: int  # micro-batches whose saved activations coexist (2: pipelined encoder)
    accumulates: bool  # grads exist in every phase (more than one micro-batch per step)
    fwd_work: dict[str, int] = field(default_factory=dict)
    bwd_work: dict[str, int] = field(default_factory=dict)
    handoff: int = 0
    sync: int = 0
    norm: int = 0
    optim: int = 0

    @property
    def saved_total(self) -> int:
        return sum(self.saved.values())

    def live(self, phase: str) -> dict[str, int]:
        """Bytes this rank holds in ``phase``, by term (only nonzero terms)."""
        mine_fwd, mine_bwd = f"{self.name}_fwd", f"{self.name}_bwd"
        order = PHASES.index
        has_grads = self.grads > 0 and (self.accumulates or order(phase) >= order(mine_bwd))
        acts = order(phase) <= order("vision_bwd") if self.name == "vision" else phase in (mine_fwd, mine_bwd)
        out = {
            "params": self.params,
            "optimizer": self.optimizer,
            "grads": self.grads if has_grads else 0,
            "activations": self.saved_total * (self.live_micro_batches if self.name == "vision" else 1)
            if acts
            else 0,
        }
        if phase == mine_fwd:
            out.update({f"fwd:{k}": v for k, v in self.fwd_work.items()})
        elif phase == mine_bwd:
            out.update({f"bwd:{k}": v for k, v in self.bwd_work.items()})
        elif phase in ("handoff", "handback"):
            out["payload"] = self.handoff
        elif phase == "grad_sync":
            out["allreduce_buffer"] = self.sync
        elif phase == "grad_norm":
            out["norm_squares"] = self.norm
        elif phase == "optimizer":
            out["optimizer_temp"] = self.optim
        return {k: int(v) for k, v in out.items() if v}


def module_terms(shape: ModuleShape, *, micro_batches: int, device: str) -> ModuleTerms:
    """All terms of one rank of ``shape``'s module; ``micro_batches`` per step per LLM replica."""
    par, pr = shape.parallel, shape.precision
    params, grads, optimizer = model_states(shape)
    a, tokens, s = pr.act, shape.tokens, shape.seq_split
    h = shape.layer.hidden
    saved = activations_of(shape)
    eager_one = eager_block_bytes(shape)
    fwd: dict[str, int] = {}
    bwd: dict[str, int] = {}
    if shape.ac.kind != "off" or not shape.backward:
        fwd["block"] = block_work_bytes(shape)
    if shape.backward and shape.ac.kind != "off":
        bwd["recompute_block"] = block_work_bytes(shape)
    if shape.backward:
        bwd["grad_hidden"] = int(2 * tokens * h / s * a)
    if eager_one:
        fwd["attention_scores"] = bwd["attention_scores"] = eager_one
    if shape.name == "vision" and par.sp > 1:
        fwd["all_to_all"] = bwd["all_to_all"] = int(2 * 3 * tokens * h / par.tp * a)
    if s > 1:
        fwd["sp_gather"] = bwd["sp_gather"] = int(tokens * h * a)
    if par.fsdp > 1:
        layer_full = shape.layer_params.per_tp_rank(par.tp)
        root_full = shape.params.per_tp_rank(par.tp) - shape.layer.layers * layer_full
        gathered = int((2 * layer_full + root_full) * a)
        fwd["fsdp_gather"] = gathered
        if shape.backward:
            bwd["fsdp_gather"] = gathered
            bwd["fsdp_reduce_scatter"] = int(layer_full * pr.reduce) if grads else 0
    if shape.name == "llm":
        v_shard = shape.vocab / par.tp
        chunk = min(shape.loss_chunk_tokens, tokens)
        if chunk < tokens:
            fwd["loss_chunk"] = int(chunk * v_shard * (a + 4))
            bwd["loss_chunk"] = int(chunk * v_shard * (a + 8))
        else:
            fwd["loss_fp32"] = bwd["loss_grad"] = int(tokens * v_shard * 4)
        handoff = int(tokens * h / s * a)
    else:
        merge = shape.arch.spatial_merge_size**2
        handoff = int(tokens / merge * shape.out_hidden * a)
    trains = grads > 0
    sync = grads if trains and par.fsdp == 1 and (par.dp > 1 or par.sp > 1) else 0
    local_largest = shape.largest_param / (par.tp * par.fsdp)
    norm = int(2 * 8 * local_largest) if trains else 0
    optim = 0
    if trains:
        owned = optimizer / pr.optimizer  # elements whose AdamW states live here
        optim = int((owned if device == "cuda" else min(owned, local_largest)) * pr.optimizer / 2)
        if par.zero == 1 and par.dp * par.sp > 1:
            optim += int(params / (par.dp * par.sp))  # one owner's coalesced broadcast buffer
    return ModuleTerms(
        name=shape.name,
        params=params,
        grads=grads,
        optimizer=optimizer,
        saved=saved,
        live_micro_batches=2 if shape.name == "vision" and micro_batches > 1 and shape.backward else 1,
        accumulates=micro_batches > 1,
        fwd_work={k: v for k, v in fwd.items() if v},
        bwd_work={k: v for k, v in bwd.items() if v},
        handoff=handoff,
        sync=int(sync),
        norm=norm,
        optim=optim,
    )


@dataclass(frozen=True)
class GpuTimeline:
    """Bytes live on one GPU per phase (summed over the modules there) and where the peak is."""

    by_phase: dict[str, int]
    peak_phase: str
    peak_terms: dict[str, int]  # "<module>.<term>" -> bytes at the peak phase

    @property
    def peak(self) -> int:
        return self.by_phase[self.peak_phase]


def gpu_timeline(modules: list[ModuleTerms]) -> GpuTimeline:
    """The timeline of the modules sharing one GPU; peak = max over phases (ties: earliest phase)."""
    by_phase: dict[str, int] = {}
    terms: dict[str, dict[str, int]] = {}
    for phase in PHASES:
        live = {f"{m.name}.{k}": v for m in modules for k, v in m.live(phase).items()}
        terms[phase] = live
        by_phase[phase] = sum(live.values())
    peak = max(PHASES, key=lambda p: (by_phase[p], -PHASES.index(p)))
    return GpuTimeline(by_phase=by_phase, peak_phase=peak, peak_terms=terms[peak])
