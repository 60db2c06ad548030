"""Memory by phase: what each module's rank holds in each phase of a step, and the peak per GPU.

One step, per micro-batch, runs these phases in order (``dhp/runtime/loop/driver.py``), then finishes
(``dhp.plan.graph.ModuleGraph.phases``: P1..Pk the producers in declaration order, C the module that
computes the loss; each phase is named ``<module>_fwd`` / ``<module>_bwd``):

    P1_fwd .. Pk_fwd, handoff, C_fwd, C_bwd, handback, Pk_bwd .. P1_bwd  (x micro-batches)
    grad_sync, grad_norm, optimizer

In each phase a module's rank holds:

- params and optimizer states: always;
- grads and saved activations, as the driver's order makes them coexist (``m`` micro-batches per
  step; a producer's (encoder's) forward of m+1 is issued before its backward of m, collocated or
  disaggregated, so it holds up to TWO micro-batches' activations ``S``; ``G`` the grads, ``G1``
  the first gradient its backward writes, the module's largest tensor: lm_head, the merger):

      phase               loss module (m=1 / m>=2)    producer (m=1 / m=2 / m>=3)
      own forward         S       / G+S              S / 2S / G+2S
      own backward        max(S+G1, G) / G+S         max(S+G1, G) / max(2S, S+G) / G+2S
      between (hand-off,  - / G                      S / max(2S, S+G) / G+2S
        the others' work)
      after its backward  G                          G

  A backward writes the head's gradient first while every saved tensor is alive, then frees each
  block's activations as it writes that block's gradients (the peak of the two together is at one
  end); accumulation keeps the previous micro-batch's grads;
- the transient of the phase it runs (``dhp/plan/memory.py``): one block's working set, all-to-all
  buffers, FSDP's gathered blocks, expert FSDP's gathered experts of one MoE layer and expert TP's
  all-gathered MoE output, the loss chunk, the hand-off payload, the flat all-reduce buffer,
  the grad-norm squares, AdamW's temporaries.

The modules of one GPU-sharing set (``dhp.config.placement``; collocated: all of them) are one
process each on one GPU: their live sets add up phase by phase on one timeline. The GPU's peak is the max over phases (transients of different phases never add). The
usable memory is the device minus a reserve per PROCESS (CUDA context, NCCL buffers) and an
allocator-fragmentation fraction of the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dhp.errors import PlanError
from dhp.plan.graph import computes_loss
from dhp.plan.memory import (
    FSDP_LAYERS_IN_FLIGHT,
    ModuleShape,
    activations_of,
    block_work_bytes,
    compute_copy_bytes,
    cp_work_bytes,
    delta_rule_work_bytes,
    eager_block_bytes,
    expert_layer_gather_elems,
    largest_local_param,
    model_states,
    non_expert_params,
    rank_params,
    relayout_copies_bytes,
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
    """Every memory term of one rank of one module (bytes); the phase each lives in is in ``phases``."""

    name: str
    params: int
    grads: int
    optimizer: int
    saved: dict[str, int]  # saved activations of ONE micro-batch, by component
    live_micro_batches: int  # micro-batches whose saved activations coexist (2: pipelined encoder)
    accumulates: bool  # grads exist in every phase (more than one micro-batch per step)
    micro_batches: int = 1  # per step (the driver's order decides what coexists, see above)
    first_grad: int = 0  # bytes of the first gradient a backward writes (the largest tensor)
    fwd_work: dict[str, int] = field(default_factory=dict)
    bwd_work: dict[str, int] = field(default_factory=dict)
    handoff: int = 0
    sync: int = 0
    norm: int = 0
    optim: int = 0
    optimizer_impl: str = ""  # train.optimizer.impl (sizes ``optim``)
    computes_loss: bool = False  # the graph's consumer (``dhp.plan.graph.computes_loss``)
    phases: tuple[str, ...] = ()  # a step's phases in order (``ModuleShape.phases``)
    #: a pipeline rank of the loss module: micro-batches of its layers whose saved activations
    #: coexist at its peak (``dhp.plan.pipeline.in_flight_micro_batches``); 1 without pipeline stages
    in_flight: float = 1.0
    stage: int = 0  # the pipeline rank these terms are of (0 without pipeline stages)

    @property
    def saved_total(self) -> int:
        return sum(self.saved.values())

    def live(self, phase: str) -> dict[str, int]:
        """Bytes this rank holds in ``phase``, by term (only nonzero terms)."""
        mine_fwd, mine_bwd = f"{self.name}_fwd", f"{self.name}_bwd"
        grads, acts = self.grads_and_activations(phase)
        out = {"params": self.params, "optimizer": self.optimizer, "grads": grads, "activations": acts}
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

    def accounted_peak(self) -> int:
        """Max over phases of params + grads + optimizer + saved activations: the transients and
        the reserve left out, i.e. what ``dhp.metrics.accounting`` measures on a running rank."""
        keys = ("params", "optimizer", "grads", "activations")
        return max(sum(v for k, v in self.live(p).items() if k in keys) for p in self.phases)

    def grads_and_activations(self, phase: str) -> tuple[int, int]:
        """(grads, saved activations) live together in ``phase`` (the table in the module docstring):
        the candidate with the larger sum over the micro-batches the phase stands for."""
        order = self.phases.index
        g, s, m = self.grads if self.grads > 0 else 0, self.saved_total, self.micro_batches
        if self.in_flight != 1.0:  # a pipeline rank: its schedule's micro-batches in flight
            s = int(s * self.in_flight)
        mine_fwd, mine_bwd = f"{self.name}_fwd", f"{self.name}_bwd"
        if order(phase) > order(mine_bwd) or (self.computes_loss and phase not in (mine_fwd, mine_bwd)):
            after = order(phase) > order(mine_bwd)
            return (g if after or (self.accumulates and g) else 0), 0
        if not self.computes_loss and self.live_micro_batches > 2:  # every forward before the
            return (g if self.accumulates else 0), self.live_micro_batches * s  # pipelined consumer's
        if not self.computes_loss and m >= 2 and self.live_micro_batches == 2:
            pair = [(0, 2 * s)] + ([] if phase == mine_fwd else [(g, s)])
            cands = [(g, 2 * s)] if m >= 3 else pair
        elif self.accumulates:  # the LLM, m >= 2 (or an encoder without backward)
            cands = [(g, s)]
        else:  # m == 1
            cands = [(0, s)] + ([(min(self.first_grad, g), s), (g, 0)] if phase == mine_bwd else [])
        return max(cands, key=lambda c: (c[0] + c[1], c[1]))


def adamw_temp_elems(impl: str, *, owned: float, largest: float) -> float:
    """Elements (in the states' dtype) of AdamW's temporaries at the peak of one step
    (``train.optimizer.impl``; torch's ``torch/optim/adam.py``): ``fused`` updates in place in one
    kernel (none); ``foreach`` builds ``sqrt(v)`` for every owned element at once (one temporary the
    size of the owned parameters); ``for_loop`` goes one parameter at a time, and while it builds
    ``sqrt(v)`` and ``sqrt(v) / bc2`` of one the previous one's ``denom`` is still bound: three of the
    largest parameter at most (the largest sit side by side: gate/up). Measured on CPU by
    ``scripts/bench_planner.py --optimizer`` (fused 0, foreach and for_loop as here)."""
    if impl == "fused":
        return 0.0
    if impl == "foreach":
        return owned
    if impl == "for_loop":
        return 3.0 * min(owned, largest)
    raise PlanError(f"train.optimizer.impl={impl!r}: unknown. Fix: use fused, foreach or for_loop.")


def module_terms(shape: ModuleShape, *, micro_batches: int, optimizer_impl: str) -> ModuleTerms:
    """All terms of one rank of ``shape``'s module; ``micro_batches`` per step per LLM replica;
    ``optimizer_impl`` (``train.optimizer.impl``) sizes AdamW's temporaries."""
    par, pr = shape.layout, shape.precision
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
    _, fwd["compute_block"], bwd["compute_block"] = compute_copy_bytes(shape)  # master weights' bf16 copies
    if eager_one:
        fwd["attention_scores"] = bwd["attention_scores"] = eager_one
    chunks = delta_rule_work_bytes(shape)
    if chunks:  # a linear block's chunk states: built in its forward, again in its backward
        fwd["delta_rule_states"] = chunks
        if shape.backward:
            bwd["delta_rule_states"] = chunks
    relayout = 2 * relayout_copies_bytes(shape, largest=True)  # a DeltaNet block's weight exchange:
    if relayout:  # the payload and the head-layout copy (its grad's two in backward)
        fwd["weight_relayout"] = relayout
        if shape.backward:
            bwd["weight_relayout"] = relayout
    if par.sp > 1 and shape.arch.sp_exchange_blocks:  # Ulysses' q/k/v exchange buffers
        fwd["all_to_all"] = bwd["all_to_all"] = int(2 * 3 * tokens * h / par.tp * a)
    fwd["cp_gather"], bwd["cp_gather"] = cp_work_bytes(shape)  # CP's all-gathered K/V or sequence
    if s > 1:
        fwd["sp_gather"] = bwd["sp_gather"] = int(tokens * h * a)
    if par.etp > 1 and shape.arch.moe_blocks:  # expert TP: the MoE output all-gathered over TP
        fwd["etp_output_gather"] = bwd["etp_output_gather"] = int(tokens * h * a)
    gathered_experts = expert_layer_gather_elems(shape)  # expert FSDP: one MoE layer's local experts
    if gathered_experts:
        fwd["expert_fsdp_gather"] = int(FSDP_LAYERS_IN_FLIGHT * gathered_experts * a)
        if shape.backward:
            bwd["expert_fsdp_gather"] = fwd["expert_fsdp_gather"]
            bwd["expert_fsdp_reduce_scatter"] = int(gathered_experts * pr.reduce) if grads else 0
    if par.fsdp > 1:  # FSDP gathers the non-expert parameters (the experts: EP's, or expert FSDP's)
        dense, dense_block = non_expert_params(shape)
        layer_full = dense_block.per_tp_rank(par.tp)
        root_full = dense.per_tp_rank(par.tp) - shape.layer.layers * layer_full
        gathered = int((2 * layer_full + root_full) * a)
        fwd["fsdp_gather"] = gathered
        if shape.backward:
            bwd["fsdp_gather"] = gathered
            bwd["fsdp_reduce_scatter"] = int(layer_full * pr.reduce) if grads else 0
    if shape.arch.vocab:  # the module computes the loss: its logits chunk; it receives the hand-off
        v_shard = shape.vocab / par.tp
        chunk = min(shape.loss_chunk_tokens, tokens)
        fwd["loss_chunk"] = int(chunk * v_shard * (a + 4))
        if shape.backward and grads:
            bwd["loss_chunk"] = int(chunk * v_shard * (a + 8))
            bwd["lm_head_grad_fp32"] = int(v_shard * h * 4)
        handoff = int(tokens * h / s * a)
    else:
        merge = shape.arch.merge
        handoff = int(tokens / merge * (shape.handoff_width or shape.out_hidden) * a)
    trains = grads > 0
    dense, experts = rank_params(shape)
    replicated = (par.fsdp == 1 and (par.dp > 1 or par.sp > 1)) or par.cp > 1  # all-reduced grads
    dense_sync = dense * shape.trainable * pr.grad if replicated else 0
    edp = par.edp  # expert grads: all-reduced over edp, on their own (expert FSDP reduce-scatters
    # them in each backward instead)
    expert_sync = experts * shape.trainable * pr.grad if edp > 1 and not par.expert_fsdp else 0
    sync = max(dense_sync, expert_sync) if trains else 0
    local_largest = largest_local_param(shape)
    norm = int(2 * 8 * local_largest) if trains else 0
    optim = 0
    if trains:
        owned = optimizer / pr.optimizer  # elements whose AdamW states live here
        optim = int(adamw_temp_elems(optimizer_impl, owned=owned, largest=local_largest) * pr.optimizer / 2)
        if par.optimizer_shards > 1:  # one owner's coalesced broadcast buffer: the
            # dense partition's over dp x sp, then the experts' over edp (one after the other;
            # none under expert FSDP, whose shards are their owners' own)
            split = par.expert_state_split
            edp_owned = experts * pr.param / split if split > 1 else 0
            optim += int(max(dense * pr.param / par.optimizer_shards, edp_owned))
    return ModuleTerms(
        name=shape.name,
        params=params,
        grads=grads,
        optimizer=optimizer,
        saved=saved,
        # a producer (no hand-off inputs) runs the next micro-batch's forward before this one's backward
        live_micro_batches=2 if not shape.arch.inputs and micro_batches > 1 and shape.backward else 1,
        accumulates=micro_batches > 1,
        micro_batches=micro_batches,
        first_grad=int(local_largest * pr.grad) if trains else 0,
        fwd_work={k: v for k, v in fwd.items() if v},
        bwd_work={k: v for k, v in bwd.items() if v},
        handoff=handoff,
        sync=int(sync),
        norm=norm,
        optim=optim,
        optimizer_impl=optimizer_impl if trains else "",
        computes_loss=computes_loss(shape.arch),
        phases=shape.phases,
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
    phases = modules[0].phases
    by_phase: dict[str, int] = {}
    terms: dict[str, dict[str, int]] = {}
    for phase in phases:
        live = {f"{m.name}.{k}": v for m in modules for k, v in m.live(phase).items()}
        terms[phase] = live
        by_phase[phase] = sum(live.values())
    peak = max(phases, key=lambda p: (by_phase[p], -phases.index(p)))
    return GpuTimeline(by_phase=by_phase, peak_phase=peak, peak_terms=terms[peak])
