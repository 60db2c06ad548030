"""Expert parallelism (EP) for transformers' own sparse-MoE blocks, applied from outside.

What it does to placements
--------------------------
A sparse-MoE block in transformers (the fused-experts layout of its recent MoE models) is ``gate`` (the top-k
router: softmax -> top-k -> renormalise) plus ``experts``, one module holding every expert as two
3-D parameters ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], called as
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.
:func:`apply_ep` swaps each block's ``experts`` for :class:`ExpertParallelExperts`, which keeps that
call signature, so the block's forward and the router stay transformers' unmodified code:

- the router is REPLICATED (every rank routes its own tokens with the full ``gate.weight`` [E, H]);
- EP rank ``r`` of an EP group of size ``ep`` owns experts ``[r*E/ep, (r+1)*E/ep)``: its
  ``gate_up_proj``/``down_proj`` are DTensors on the 1-D ``ep`` mesh with placement ``Shard(0)``,
  whose local tensors are those rows of the full tensors. The FQNs stay the checkpoint's
  (``...mlp.experts.gate_up_proj``), so DCP saves/loads/reshards them (ep=2 -> ep=1 and back) like any
  DTensor, ``full_tensor()`` gives the HF tensor for export, and a full HF checkpoint loads by
  slicing rows :func:`local_expert_range`. DTensor rather than plain local parameters for exactly
  this: the global shape and the shard's offset travel with the tensor, so nothing else needs a
  mapping table.
- forward, per block: each rank sorts its ``T*k`` (token, expert) assignments by expert, exchanges
  the per-expert counts (one ``all_to_all_single`` of ``E`` int64), sends the token rows to the
  experts' ranks (dispatch: ``all_to_all_single``, uneven splits), runs its local experts on what it
  received (:func:`grouped_expert_mlp`), sends the outputs back (combine: the reverse
  ``all_to_all_single``) and only then multiplies by the routing weights and sums over ``k`` on the
  token's own rank. Dropless: no capacity factor, no padding, every assignment is computed, so the
  result equals the single-process block up to float summation order. Because the weighting happens
  on the token's own rank, the routing weights' gradient (and so the router's) is computed locally
  from the combined expert outputs; nothing about the router crosses the wire.
- backward: the autograd of both all-to-alls is the reverse all-to-all, so each rank's expert
  gradients already hold the contributions of every token of its EP group, from every EP rank.

The mesh ("MoE parallel folding", as in Megatron-Core)
------------------------------------------------------
Attention and the dense parts keep the module's own axes (dp, fsdp, cp, sp, tp). For the MoE layers the
ranks of the module's dp x fsdp x cp x sp axes (the ranks that see DIFFERENT tokens) are folded into one
axis of size ``n`` and re-split as ``edp x ep`` with ``ep`` innermost (consecutive ranks, so an EP group
prefers SP neighbours, then FSDP, then DP: the most local links). :func:`ep_mesh` builds this as a
3-D DeviceMesh ``("erep", "edp", "ep")`` from the layout's fold (``ParallelLayout.expert_grid``, the one
place the fold is computed):

- ``etp = 1`` (the default): ``erep`` is the module's tp axis; every TP rank of a unit holds the same
  experts and runs them on the same tokens (correct, redundant compute);
- ``etp = tp`` (expert TP over the expert axis, torchtitan's and Megatron's "EP borrows TP"): ``erep``
  is 1 and an all-to-all group takes every TP rank of its ``ep`` units (``ep x tp`` ranks, each with
  ``E / (ep x tp)`` experts). Inside the experts module each TP rank keeps 1/tp of the unit's
  (identical) tokens (``dhp.parallel.expert_tp.TakeMyRows``: forward a row slice, backward an all-gather of the rows'
  gradients, so the replicated input's gradient stays whole on every TP rank), routes only those,
  and the outputs are all-gathered back over TP (``expert_tp.GatherRows``: backward takes the own rows of
  the replicated output's gradient). No TP rank repeats another's expert work. Expert TP inside each
  expert (column/row slices of ``I``) is not what this does: transformers fuses gate and up in one
  ``[E, 2I, H]`` tensor whose per-rank slice (gate rows and up rows) is not one block, so a DCP
  checkpoint could not keep the HF layout.

Expert FSDP (``expert_fsdp``, :func:`dhp.parallel.fsdp.apply_expert_fsdp`): each experts module is its
own FSDP2 unit on the ``edp`` axis of this mesh, so the expert DTensors become 2-D
(``(edp, ep)``: Shard over both) and a rank holds ``1/(ep x etp x edp)`` of the experts' parameters,
gradients and AdamW states; the unit all-gathers its local experts over ``edp`` before its forward (and
again in backward) and reduce-scatters their gradients (SUM) after.

Gradient reduction contract (the caller's finalize step):

- expert parameters: SUM over ``edp`` (:func:`reduce_expert_grads_`; FSDP2's reduce-scatter under
  expert FSDP), never over dp/sp: the ranks of an EP group hold different experts, so a dp all-reduce that included them would add unrelated
  shards together. :func:`expert_params` lists them so a DP/ZeRO-1/FSDP step can exclude them.
- everything else (router included): as the module's plan already does (SUM over dp, sp, ...).
- the load-balancing loss is a product of two batch means, so a per-rank HF aux loss summed or
  averaged over DP ranks is NOT the global one; ``dhp.parallel.load_balancing`` all-reduces the
  per-expert counts and gives each rank its exact share of the loss over the step's tokens (shares
  sum to the HF value on the concatenated batch; their gradients, summed, are its gradient).

Memory per rank
---------------
- expert parameters and their gradients: ``1/(ep*etp)`` of the dense-replicated amount
  (``3*E*I*H/(ep*etp)`` parameters per MoE layer), the same on every ``edp`` rank, or ``1/(ep*etp*edp)``
  under expert FSDP (plus one MoE layer's local experts gathered while it runs); their AdamW states
  alike, or ``1/(ep*edp)`` with ZeRO-1 (``dhp.parallel.dp.Zero1AdamW`` partitions them over ``edp``, per tensor);
  router and dense parts unchanged.
- dispatch and combine buffers, per MoE layer and per micro-batch: ``T*k`` rows of ``H`` each way
  (the rows a rank sends, and the rows it receives: ``T*k`` on average, up to ``ep*T*k`` under a fully
  unbalanced router, which is the planner's worst case), plus the sorted copy of the local
  assignments (``T*k*H``) and the expert activations of the received rows (``rows*2I``), all kept
  for backward unless the block is recomputed.

Composition (what is proven, what is not yet)
---------------------------------------------
- activation checkpointing (``dhp.parallel.ac``, full and selective): exact; backward recomputes the
  block and so re-issues the 3 forward exchanges of each MoE layer (the selective policy keeps no
  eager c10d output), i.e. 8 all-to-alls per MoE layer per step instead of 5.
- DCP checkpoints: ep=2 -> ep=1 and ep=1 -> ep=2, bit for bit.
- DP: tested (non-expert grads SUMMED over the ranks, expert grads over ``edp``).
- the runtime (``dhp.parallel.parallelize`` applies EP first, from ``plan.moe_blocks``; then
  ``finalize_grads``/``grad_norm_sq``/``clip_grads_``/``build_optimizer``): tested at fsdp=2 x ep=2 and at
  dp=2 x tp=2 (attention) x ep=2 against the single-process model over 3 AdamW steps, and a resume
  through ``dhp.checkpoint`` ep=2 -> ep=1 -> ep=2 with the AdamW states, bit for bit.
  FSDP ignores the expert parameters: they stay sharded over ``ep`` and REPLICATED over ``edp`` (their
  grads are summed over ``edp`` by ``finalize_grads``). ZeRO-1 (dp=4 x ep=2, edp=2: tested) partitions
  their AdamW states over ``edp``, each owner broadcasting its updated experts over ``edp`` after the
  step; the checkpoint of those states resumes at the same plan and at ep=1.
- refused: LoRA on experts (``dhp.parallel.lora``: the 3-D parameters are not ``nn.Linear``), sequence
  parallelism inside TP with ep > 1 (the plan-validity rule).
- expert TP over the expert axis (``etp = tp``) and expert FSDP over ``edp``: tested against the
  single-process model (``tests/parity/test_expert_axes.py``), with resumes across them.

Expert compute: :func:`grouped_expert_mlp` is the one function both devices use. It calls
``torch._grouped_mm`` on CUDA (bf16, compute capability >= 8.0, ``H`` and ``I`` multiples of 8)
and a per-expert loop otherwise; ``grouped_mm_used`` says which. This torch's CPU kernel runs backward
only for a dense incoming gradient (a stride-0 one raises), so the CPU path stays the loop; the grouped
path's forward and backward are held against the loop on CPU by ``tests/parity/test_ep_grouped_mm.py``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from dhp.errors import PlanError
from dhp.layout import EXPERT_MESH_AXES, ParallelLayout
from dhp.parallel.expert_tp import GatherRows, TakeMyRows, tp_rows

# ---------------------------------------------------------------------------------------------- mesh


def ep_mesh(module_mesh: DeviceMesh, layout: ParallelLayout) -> DeviceMesh:
    """The MoE mesh ``("erep", "edp", "ep")`` folded from the module's token-parallel ranks, as
    ``layout.expert_grid()`` lays them out ([tp / etp][edp][ep x etp]; dhp.layout). Collective over the
    module world (creates the new axes' process groups); PlanError when ``layout.ep`` does not divide the
    fold, etp is neither 1 nor tp, or the layout is not the module mesh's."""
    n, ep = layout.token_ranks, layout.ep
    if ep < 1 or n % ep:
        raise PlanError(
            f"parallel.ep={ep} must divide the module's dp x fsdp x cp x sp ranks ({n}); "
            f"pick ep among {[d for d in range(1, n + 1) if n % d == 0]}."
        )
    if layout.etp not in (1, layout.tp):
        raise PlanError(f"parallel.etp={layout.etp} must be 1 or tp={layout.tp}.")
    if module_mesh.size() != layout.world_size:
        raise PlanError(
            f"ep_mesh: the module mesh has {module_mesh.size()} ranks, its layout {layout.world_size}."
        )
    ranks = module_mesh.mesh.flatten()  # the layout's rank r is the mesh's r-th rank (row-major)
    if layout.pp > 1:  # one grid per pipeline stage, each over its own ranks
        grid = ranks[torch.tensor(layout.stage_expert_grids(), dtype=torch.long)]
        return DeviceMesh(module_mesh.device_type, grid, mesh_dim_names=("pp", *EXPERT_MESH_AXES))
    grid = ranks[torch.tensor(layout.expert_grid(), dtype=torch.long)]
    return DeviceMesh(module_mesh.device_type, grid, mesh_dim_names=EXPERT_MESH_AXES)


def local_expert_range(num_experts: int, ep_group_mesh: DeviceMesh) -> tuple[int, int]:
    """[lo, hi) of the experts this rank owns on the 1-D ``ep`` mesh (rows of the full 3-D tensors)."""
    ep = ep_group_mesh.size()
    if num_experts % ep:
        raise PlanError(
            f"parallel.ep x etp={ep} must divide the number of experts ({num_experts}); "
            f"pick ep among {[d for d in range(1, num_experts + 1) if num_experts % d == 0]}."
        )
    per = num_experts // ep
    r = ep_group_mesh.get_local_rank()
    return r * per, (r + 1) * per


# ------------------------------------------------------------------------------------ expert compute


def grouped_mm_used(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether :func:`grouped_expert_mlp` takes ``torch._grouped_mm`` for these tensors (else the loop).

    ``torch._grouped_mm`` needs CUDA with compute capability >= 8.0, bf16 operands and rows whose byte
    strides are 16-byte aligned (``H`` and ``I`` multiples of 8 in bf16). The CPU kernel of this torch
    has a backward only for dense incoming gradients, so CPU always loops.
    """
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda):
        return False
    if torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    same = x.dtype == gate_up.dtype == down.dtype == torch.bfloat16
    return same and x.shape[-1] % 8 == 0 and down.shape[-1] % 8 == 0


def grouped_expert_mlp(
    x: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``down_e(act(gate_e(x)) * up_e(x))`` for rows grouped by expert: ``counts[e]`` rows for expert ``e``.

    ``x`` [N, H] sorted by expert; ``counts`` [E_local] int (sums to N); ``gate_up`` [E_local, 2I, H]
    (gate rows first, then up, as transformers' fused layout); ``down`` [E_local, H, I]. Returns
    [N, H] in the same row order. Every local expert takes part in autograd even with zero rows, so
    each expert parameter always gets a (possibly zero) gradient on every rank.
    """
    path = _grouped_path if grouped_mm_used(x, gate_up, down) else _loop_path
    return path(x, counts, gate_up, down, act)


Act = Callable[[torch.Tensor], torch.Tensor]


def _grouped_path(
    x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Act
) -> torch.Tensor:
    """One ``torch._grouped_mm`` per projection; group ``e`` is rows ``[offs[e-1], offs[e])``."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gate, up = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(act(gate) * up, down.transpose(-2, -1), offs=offs)


def _loop_path(
    x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Act
) -> torch.Tensor:
    """One ``F.linear`` pair per local expert (the arithmetic of transformers' eager experts loop)."""
    outs = []
    for e, rows in enumerate(x.split(counts.tolist(), dim=0)):
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(act(gate) * up, down[e]))
    return torch.cat(outs, dim=0)


# --------------------------------------------------------------------------------- dispatch/combine


class _AllToAll(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` of rows with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup):  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        g = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return g, None, None, None


def _exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[E] tokens this rank sends per expert -> [ep * E_local] tokens it receives, per source rank and local expert."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received


class ExpertParallelExperts(nn.Module):
    """Drop-in for a transformers experts module: this rank's ``E/ep`` experts, tokens exchanged by all-to-all.

    Parameters ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] are DTensors ``Shard(0)`` on the
    1-D ``ep`` mesh (local: [E/ep, 2I, H] and [E/ep, H, I]). ``forward(hidden [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H]`` is collective over the EP group: every EP rank must call it for
    every MoE block in the same order (a rank with no tokens still calls it with T = 0). With
    ``tp_group`` (expert TP, ``etp = tp``) the inputs are the unit's, equal on its TP ranks: each keeps
    its :func:`tp_rows` of them, and the output is gathered back whole over ``tp_group``.
    """

    def __init__(
        self,
        experts: nn.Module,
        ep_group_mesh: DeviceMesh,
        *,
        fold_mesh: DeviceMesh | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.fold_mesh = fold_mesh  # the 3-D (erep, edp, ep) mesh: finalize reduces over its edp
        self.tp_group = tp_group  # expert TP: the unit's TP ranks split its tokens
        _check_layout(experts)
        self.num_experts = experts.gate_up_proj.shape[0]
        self.mesh = ep_group_mesh
        self.group = ep_group_mesh.get_group()
        self.ep = ep_group_mesh.size()
        lo, hi = local_expert_range(self.num_experts, ep_group_mesh)
        self.num_local_experts = hi - lo
        self.act_fn = experts.act_fn
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            local = full.detach()[lo:hi].clone()  # this rank's rows only; the full tensor is dropped
            dt = DTensor.from_local(local, ep_group_mesh, [Shard(0)], run_check=False)
            setattr(self, name, nn.Parameter(dt, requires_grad=full.requires_grad))
        self.last_a2a_rows = 0  # rows this rank handed to dispatch + combine in its last forward
        self.last_routed_tokens = 0  # tokens this rank routed in its last forward (1/tp of them under etp)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.tp_group is None:
            return self._routed(hidden_states, top_k_index, top_k_weights)
        total, group = hidden_states.shape[0], self.tp_group
        lo, hi = tp_rows(total, dist.get_world_size(group), dist.get_rank(group))
        mine = self._routed(
            TakeMyRows.apply(hidden_states, group),
            top_k_index[lo:hi],
            TakeMyRows.apply(top_k_weights, group),
        )
        return GatherRows.apply(mine, total, group)

    def _routed(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Dispatch, local experts, combine, weighting: the tokens this rank routes."""
        t, k = top_k_index.shape
        self.last_routed_tokens = t
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, hence by EP rank
        sent = hidden_states[order // k]
        counts = torch.bincount(flat, minlength=self.num_experts)
        received = _exchange_counts(counts, self.group).view(self.ep, self.num_local_experts)
        in_splits = counts.view(self.ep, self.num_local_experts).sum(1).tolist()
        out_splits = received.sum(1).tolist()

        rows = _AllToAll.apply(sent, out_splits, in_splits, self.group)  # dispatch
        # received rows are grouped by source rank, then by local expert: regroup by local expert
        expert_of_row = torch.arange(self.num_local_experts, device=flat.device).repeat(self.ep)
        by_expert = torch.argsort(torch.repeat_interleave(expert_of_row, received.reshape(-1)), stable=True)
        x = rows[by_expert]
        y = grouped_expert_mlp(  # weights in the activations' dtype (an FSDP bf16 policy casts the rest)
            x,
            received.sum(0),
            self.gate_up_proj.to_local().to(x.dtype),
            self.down_proj.to_local().to(x.dtype),
            self.act_fn,
        )
        y = y[torch.argsort(by_expert)]
        back = _AllToAll.apply(y, in_splits, out_splits, self.group)  # combine
        self.last_a2a_rows = sum(in_splits) + sum(out_splits)

        out = back[torch.argsort(order)].view(t, k, -1)
        return (out * top_k_weights.unsqueeze(-1).to(out.dtype)).sum(1).to(hidden_states.dtype)


def _check_layout(experts: nn.Module) -> None:
    """Refuse an experts module whose layout this strategy does not implement (clear error, no fallback)."""
    for name in ("gate_up_proj", "down_proj", "act_fn"):
        if not hasattr(experts, name):
            raise PlanError(
                f"expert parallelism: {type(experts).__name__} has no `{name}`; EP supports transformers' "
                "fused 3-D experts (gate_up_proj [E, 2I, H], down_proj [E, H, I], act_fn)."
            )
    flags = {
        "has_gate": True,
        "is_transposed": False,
        "has_bias": False,
        "has_post_expert_norm": False,
        "is_concatenated": True,
    }
    wrong = {
        f: getattr(experts, f) for f, ok in flags.items() if hasattr(experts, f) and getattr(experts, f) != ok
    }
    if wrong:
        raise PlanError(
            f"expert parallelism: {type(experts).__name__} has {wrong}; only the untransposed, concatenated, "
            "bias-free layout is implemented. Set parallel.ep=1 for this model."
        )
    if isinstance(experts.gate_up_proj, DTensor):
        raise PlanError("expert parallelism: experts are already DTensors; apply EP before TP/FSDP, once.")


# --------------------------------------------------------------------------------------------- apply


def apply_ep(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    block_glob: str,
    experts_attr: str = "experts",
    tp_group: dist.ProcessGroup | None = None,
) -> list[str]:
    """Swap ``experts_attr`` of every block matching ``block_glob`` for :class:`ExpertParallelExperts`.

    ``mesh`` is :func:`ep_mesh`'s 3-D mesh (its ``ep`` axis is used); ``tp_group``: the module's TP
    group under expert TP (``etp = tp``), None otherwise. ``block_glob`` is an FQN glob the
    family declares (e.g. ``"language_model.layers.*.mlp"``); blocks without ``experts_attr`` (dense
    MLP layers) are skipped. Apply before TP/FSDP and before building the optimizer. Returns the FQNs
    swapped; raises PlanError when none matched.
    """
    ep_axis = mesh["ep"]
    done = []
    for fqn, sub in list(module.named_modules()):
        if fnmatch.fnmatchcase(fqn, block_glob) and hasattr(sub, experts_attr):
            swapped = ExpertParallelExperts(
                getattr(sub, experts_attr), ep_axis, fold_mesh=mesh, tp_group=tp_group
            )
            setattr(sub, experts_attr, swapped)
            done.append(f"{fqn}.{experts_attr}")
    if not done and getattr(module, "pipeline_stages", None) is None:  # a pipeline stage may hold none
        raise PlanError(
            f"apply_ep: no module matches block glob {block_glob!r} with a `{experts_attr}` child."
        )
    return done


def expert_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(FQN, parameter) of every expert-parallel parameter: reduce these over ``edp``, the rest as usual."""
    return [
        (f"{m}.{n}" if m else n, p)
        for m, sub in module.named_modules()
        if isinstance(sub, ExpertParallelExperts)
        for n, p in sub.named_parameters(recurse=False)
    ]


def expert_fold_mesh(module: nn.Module) -> DeviceMesh | None:
    """The :func:`ep_mesh` that :func:`apply_ep` swapped ``module``'s experts over (None: no EP here)."""
    for sub in module.modules():
        if isinstance(sub, ExpertParallelExperts) and sub.fold_mesh is not None:
            return sub.fold_mesh
    return None


def reduce_expert_grads_(params: Iterable[nn.Parameter], mesh: DeviceMesh) -> None:
    """SUM the local expert gradients over the ``edp`` axis of :func:`ep_mesh` (no-op when edp = 1)."""
    edp = mesh["edp"]
    if edp.size() == 1:
        return
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=edp.get_group())
