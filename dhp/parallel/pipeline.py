"""Pipeline parallelism inside a module group: the LLM's decoder layers cut into stages over the
``pp`` mesh axis (``dhp.layout``), run by ``torch.distributed.pipelining``'s schedules.

Placement: pipeline rank ``s`` (the ranks of one ``pp`` coordinate) holds the layers of its stages
``s, s + pp, ...`` (``ParallelLayout.stages_of``), cut by :func:`dhp.layout.stage_cut`; the first stage
also the token embedding (and it takes the encoders' rows), the last the final norm, ``lm_head`` and
loss. Every other axis (dp, fsdp, tp, ep, ...) is the stage's own: TP, FSDP and EP then shard only the
layers a stage holds. The layers keep their global index in the module (``StageLayers``), so parameter
FQNs, checkpoints and the HF export are those of the unsplit model and a run resumes at any ``pp``.

One step runs every micro-batch of a data replica through one schedule (:func:`run_pipeline`):
``1f1b``, ``gpipe``, ``interleaved_1f1b`` and ``zero_bubble`` (torch's ``ScheduleInterleavedZeroBubble``,
the backward split into input and weight halves). Between stages travel the hidden states
``(B * S, H)`` in the compute dtype, padded to the step's longest micro-batch (torch's stages keep one
buffer shape per step; the padding rows carry zero gradient, so the math is unchanged). Every stage
computes the micro-batch's positions and masks itself from the batch (M-RoPE reaches every stage);
DeepStack features are added on the stage that holds their layer. Memory: a stage keeps the
activations of the micro-batches in flight (1F1B: up to ``pp - s`` on pipeline rank ``s``; GPipe: all).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from dhp.errors import PlanError
from dhp.layout import ParallelLayout

__all__ = [
    "MicroBatch", "StageLayers", "apply_pp", "broadcast_stats", "forward_only", "later_stages_take_rows", "over_pipeline",
    "pipeline_group", "route_statistics_pass", "run_pipeline", "stage_ranges",
]  # fmt: skip

_SCHEDULES: dict[str, type] = {
    "1f1b": Schedule1F1B,
    "gpipe": ScheduleGPipe,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}


class StageLayers(nn.ModuleList):
    """The decoder layers one pipeline rank holds, each under its GLOBAL index (``layers.12`` stays
    ``layers.12``), iterated in order: what transformers' text model loops over."""

    def __init__(self, layers: dict[int, nn.Module] | list[nn.Module] | None = None) -> None:
        super().__init__()
        items = layers.items() if isinstance(layers, dict) else enumerate(layers or [])
        for i, layer in items:
            self.add_module(str(i), layer)


def _text_model(module: nn.Module) -> nn.Module:
    lm = getattr(module, "language_model", None)
    if lm is None or not isinstance(getattr(lm, "layers", None), nn.ModuleList):
        raise PlanError(
            f"pipeline parallelism cuts an LLM module's language_model.layers; {type(module).__name__} "
            "has none. Fix: set parallel.pp=1 for this module."
        )
    return lm


def stage_ranges(layers: int, layout: ParallelLayout) -> list[tuple[int, int]]:
    """``[lo, hi)`` decoder layers of every stage (``dhp.layout.stage_cut`` over pp x pp_virtual)."""
    return layout.stage_ranges(layers)


def apply_pp(module: nn.Module, layout: ParallelLayout, rank: int, *, tied: bool = False) -> nn.Module:
    """Keep only this rank's stages of ``module`` (in place): its decoder layers under their global
    indices; the embedding only on the first stage, the final norm and ``lm_head`` only on the last.
    Records the rank's stages as ``module.pipeline_stages`` ``[(stage, lo, hi), ...]`` and the other
    stages' state-dict keys as ``module.pipeline_dropped``. Frees the other
    stages' parameters (a rank then holds ~1/pp of the decoder). PlanError for ``tied`` word embeddings
    (the embedding and ``lm_head`` would live on different stages)."""
    if tied:
        raise PlanError(
            "pipeline parallelism with tied word embeddings: the embedding (first stage) and lm_head (last "
            "stage) are one tensor. Fix: set parallel.pp=1 for this module, or untie them "
            "(model.llm.tie_word_embeddings=false, which changes the model)."
        )
    lm = _text_model(module)
    before = set(module.state_dict(keep_vars=True))
    ranges = stage_ranges(len(lm.layers), layout)
    mine = layout.stages_of(rank)
    kept = {i: lm.layers[i] for s in mine for i in range(*ranges[s])}
    lm.layers = StageLayers(dict(sorted(kept.items())))
    if not layout.is_first_stage(rank):
        lm.embed_tokens = None
    if not layout.holds_last_stage(rank):
        lm.norm = None
        module.lm_head = None
    module.pipeline_stages = [(s, *ranges[s]) for s in mine]
    # the other stages' state: a checkpoint of the unsplit module holds it, and loading skips it
    module.pipeline_dropped = frozenset(before - set(module.state_dict(keep_vars=True)))
    return module


def later_stages_take_rows(module: nn.Module, layout: ParallelLayout) -> bool:
    """Whether a stage off the first pipeline rank reads hand-off rows: one whose layers take DeepStack
    features (``module.num_deepstack`` levels, added after layers 0..K-1); the same on every rank."""
    levels = int(getattr(module, "num_deepstack", 0) or 0)
    if levels == 0:
        return False
    layers = int(module.language_model.config.num_hidden_layers)
    cut = stage_ranges(layers, layout)
    return any(lo < levels for s, (lo, _) in enumerate(cut) if s % layout.pp != 0)


def pipeline_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group of this rank's pipeline (its ``pp`` axis)."""
    return mesh["pp"].get_group()


@contextmanager
def _stage_view(module: nn.Module, lo: int, hi: int, *, last: bool):
    """Make ``module.language_model`` run only layers ``[lo, hi)`` (and its final norm only when
    ``last``): its layer list, its config's layer count and layer types swapped for the call."""
    lm = module.language_model
    saved = (lm.layers, lm.config, lm.norm)
    held = dict(saved[0].named_children())
    layers = StageLayers({i: held[str(i)] for i in range(lo, hi)})
    cfg = copy.copy(saved[1])
    cfg.num_hidden_layers = hi - lo
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(saved[1].layer_types[lo:hi])
    lm._modules["layers"] = layers  # not a new registration: the same parameters, a narrower list
    lm.config = cfg
    if not last:
        lm._modules["norm"] = nn.Identity()
    try:
        yield
    finally:
        lm._modules["layers"], lm.config = saved[0], saved[1]
        lm._modules["norm"] = saved[2]


@dataclass
class MicroBatch:
    """One micro-batch's inputs for every stage: the family's batch keywords and edge inputs, and the
    rows ``B * S`` of its hidden states."""

    inputs: dict[str, Any]
    shape: tuple[int, int]  # (B, S) of the hidden states
    stats: dict[str, Any] = field(default_factory=dict)  # filled on the last stage


class _WithLoss(torch.autograd.Function):
    """``hidden`` unchanged forward; backward also seeds ``loss``'s gradient with 1, so a loss term computed
    on a stage that is not the last (its share of the router term) is backpropagated with the stage's
    output (Megatron's auxiliary-loss scaler)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def _stage_share(module: nn.Module, out: Any, call: Any) -> torch.Tensor | None:
    """A non-last stage's own loss term, when its family has one (``stage_router_share``)."""
    fn = getattr(module, "stage_router_share", None)
    return None if fn is None else fn(out, call)


class _Stage(nn.Module):
    """One pipeline stage as torch's ``PipelineStage`` calls it: ``forward(x, mb)`` -> the padded hidden
    states, or on the last stage the micro-batch's ``loss_sum / T``."""

    def __init__(self, module: nn.Module, lo: int, hi: int, *, first: bool, last: bool,
                 micro_batches: list[MicroBatch], rows: int, num_label_tokens: int) -> None:  # fmt: skip
        super().__init__()
        self.inner = [module]  # not a submodule: the LLM's parameters stay under their own FQNs
        # the stage's own parameters, for the schedules that take weight gradients apart (zero bubble)
        lm = module.language_model
        held = dict(lm.layers.named_children())
        parts = [held[str(i)] for i in range(lo, hi)]
        parts += [lm.embed_tokens] if first else []
        parts += [lm.norm, module.lm_head] if last else []
        self.parts = nn.ModuleList(parts)
        self.lo, self.hi, self.first, self.last = lo, hi, first, last
        self.micro_batches, self.rows, self.num_label_tokens = micro_batches, rows, num_label_tokens

    def forward(self, x: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
        # through the module's own forward, so that its hooks (FSDP2's root unshard) run around it
        return self.inner[0](pipeline_stage=functools.partial(self._body, x, int(mb)))

    def _body(self, x: torch.Tensor, index: int, module: nn.Module) -> torch.Tensor:
        m = self.micro_batches[index]
        b, s = m.shape
        hidden = None if self.first else x[: b * s].view(b, s, -1)
        call = module.prepare(**m.inputs, hidden_states=hidden)
        kwargs = dict(call.kwargs)
        deepstack = kwargs.get("deepstack_visual_embeds")
        if deepstack is not None:  # feature k is added after global layer k: this stage's share
            kwargs["deepstack_visual_embeds"] = deepstack[self.lo : self.hi] or None
            if kwargs["deepstack_visual_embeds"] is None:
                kwargs.pop("visual_pos_masks", None)
        with _stage_view(module, self.lo, self.hi, last=self.last):
            out = module.language_model(input_ids=None, inputs_embeds=call.inputs_embeds, **kwargs)
        if call.state.get("batch_statistics"):  # the step-statistics pass: this stage's routing sums
            m.stats = {"route": module.stage_route_statistics(out, call)}
            if self.last:
                return torch.zeros((), device=x.device)
        elif self.last:
            res = module.finish(out, call)
            m.stats = {"loss_sum": res.loss_sum.detach(), "num_tokens": int(res.num_tokens),
                       "aux_losses": {k: v.detach() for k, v in res.aux_losses.items()}}  # fmt: skip
            return res.loss_sum / self.num_label_tokens
        h = out.last_hidden_state.reshape(b * s, -1)
        share = None if call.state.get("batch_statistics") else _stage_share(module, out, call)
        if share is not None:  # this stage's router term: its gradient rides on the hidden states' backward
            m.stats = {"loss_sum": share.detach()}
            h = _WithLoss.apply(h, share / self.num_label_tokens)
        return torch.nn.functional.pad(h, (0, 0, 0, self.rows - b * s))


def run_pipeline(
    module: nn.Module,
    mesh: DeviceMesh,
    layout: ParallelLayout,
    micro_batches: list[MicroBatch],
    *,
    rank: int,
    hidden: int,
    dtype: torch.dtype,
    num_label_tokens: int,
    device: torch.device,
) -> None:
    """Forward and backward of every micro-batch of this replica through the pipeline's schedule
    (gradients accumulate in the stage's parameters and in the edge-input leaves; the last stage's
    statistics land in each ``MicroBatch.stats``). Collective over the ``pp`` axis (point-to-point)."""
    group = pipeline_group(mesh)
    rows = max(b * s for b, s in (m.shape for m in micro_batches))
    n = len(micro_batches)
    num_stages = layout.num_stages
    stages = []
    for s, lo, hi in module.pipeline_stages:
        first, last = s == 0, s == num_stages - 1
        stage_module = _Stage(module, lo, hi, first=first, last=last, micro_batches=micro_batches,
                              rows=rows, num_label_tokens=num_label_tokens)  # fmt: skip
        # the hidden states carry gradients between stages: their meta tensors say so
        x = torch.empty((1, 0) if first else (rows, hidden), device="meta", dtype=dtype)
        x.requires_grad_(not first)
        out = (
            torch.empty((), device="meta", dtype=torch.float32)
            if last
            else torch.empty(rows, hidden, device="meta", dtype=dtype, requires_grad=True)
        )
        stages.append(PipelineStage(stage_module, s, num_stages, device, input_args=(x,),
                                    output_args=out, group=group))  # fmt: skip
    cls = _SCHEDULES[layout.pp_schedule]
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] = lambda out, _target: out  # noqa: E731
    kw = dict(n_microbatches=n, loss_fn=loss_fn, scale_grads=False)
    schedule = cls(stages if layout.pp_virtual > 1 else stages[0], **kw)
    holds_first = any(s == 0 for s, _, _ in module.pipeline_stages)
    holds_last = any(s == num_stages - 1 for s, _, _ in module.pipeline_stages)
    # torch's step() cuts its inputs along dim 0 into the micro-batches: chunk i of ``mb`` is [i]
    args = (torch.empty(n, 0, device=device, dtype=dtype),) if holds_first else ()
    schedule.step(
        *args,
        mb=torch.arange(n, device=device),
        target=torch.zeros(n, device=device) if holds_last else None,
        losses=[] if holds_last else None,
        return_outputs=False,
    )


def over_pipeline(tensors: dict[str, torch.Tensor], mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """``tensors`` (this stage's ``{fqn: full tensor}``) merged over the ``pp`` axis on its first rank
    (the others return their own); itself without pipeline stages. Collective over the pipeline."""
    if "pp" not in (mesh.mesh_dim_names or ()) or mesh["pp"].size() == 1:
        return tensors
    group = pipeline_group(mesh)
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, tensors, group=group)
    if dist.get_rank(group) != 0:
        return tensors
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def forward_only(
    module: nn.Module, mesh: DeviceMesh, layout: ParallelLayout, micro_batch: MicroBatch, *, hidden: int,
    dtype: torch.dtype, device: torch.device, num_label_tokens: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """One micro-batch's forward through every stage in order, without gradient (evaluation): stage
    ``s`` receives the hidden states from stage ``s - 1``'s rank and sends its own to ``s + 1``'s; the
    last stage's statistics (``loss_sum``, ``num_tokens``, ``aux_losses``), on every rank of the
    pipeline. Memory: one stage's activations at a time."""
    group = pipeline_group(mesh)
    b, s = micro_batch.shape
    rows = b * s
    num_stages = layout.num_stages
    mine = {st: (lo, hi) for st, lo, hi in module.pipeline_stages}
    x = torch.empty(1, 0, device=device, dtype=dtype)
    stats: dict[str, Any] = {}
    with torch.no_grad():
        for st in range(num_stages):
            if st not in mine:
                continue
            first, last = st == 0, st == num_stages - 1
            if not first:
                x = torch.empty(rows, hidden, device=device, dtype=dtype)
                dist.recv(x, group=group, group_src=(st - 1) % layout.pp)
            stage = _Stage(module, *mine[st], first=first, last=last, micro_batches=[micro_batch],
                           rows=rows, num_label_tokens=num_label_tokens)  # fmt: skip
            x = stage(x, torch.tensor(0))
            if not last:
                dist.send(x.contiguous(), group=group, group_dst=(st + 1) % layout.pp)
            else:
                stats = micro_batch.stats
    return _broadcast_stats(stats, group, src=layout.pp - 1, device=device)


def _broadcast_stats(
    stats: dict[str, Any], group: dist.ProcessGroup, *, src: int, device: torch.device
) -> dict[str, Any]:
    return broadcast_stats([stats], group, src=src, device=device)[0]


def broadcast_stats(
    stats: list[dict[str, Any]], group: dist.ProcessGroup, *, src: int, device: torch.device
) -> list[dict[str, Any]]:
    """Every micro-batch's statistics on every rank of the pipeline: the last stage's label tokens and
    auxiliary losses, the loss summed over the stages (a non-last stage may add its router share); a
    broadcast of the auxiliary losses' names, then an all-reduce of one float64 row per micro-batch."""
    box = [sorted(stats[0].get("aux_losses", {})) if stats and stats[0] else None]
    dist.broadcast_object_list(box, group=group, group_src=src)
    names: list[str] = box[0] or []
    table = torch.zeros(len(stats), 2 + len(names), dtype=torch.float64, device=device)
    for m, st in enumerate(stats):
        if "loss_sum" in st:  # every stage's loss part (a non-last stage's: its router share)
            table[m, 0] = float(st["loss_sum"])
        if "num_tokens" in st:  # the last stage's
            table[m, 1] = float(st["num_tokens"])
            for i, k in enumerate(names):
                table[m, 2 + i] = float(st["aux_losses"][k])
    dist.all_reduce(table, group=group)
    return [
        {"loss_sum": row[0], "num_tokens": int(row[1]), "aux_losses": dict(zip(names, row[2:], strict=True))}
        for row in table.tolist()
    ]


def route_statistics_pass(
    module: nn.Module, mesh: DeviceMesh, layout: ParallelLayout, micro_batches: list[MicroBatch], *,
    hidden: int, dtype: torch.dtype, device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """The step-statistics pass through the pipeline: every micro-batch forward without gradient,
    stage by stage (``inputs`` carry ``batch_statistics=True``), each stage adding its own layers'
    routing sums; returns the step's sums over every stage and micro-batch (the same on every rank:
    an all-reduce over the pipeline). Memory: one stage's forward transients at a time."""
    group = pipeline_group(mesh)
    mine = {st: (lo, hi) for st, lo, hi in module.pipeline_stages}
    total: torch.Tensor | None = None
    with torch.no_grad():
        for m in micro_batches:
            b, s = m.shape
            rows = b * s
            x = torch.empty(1, 0, device=device, dtype=dtype)
            for st in range(layout.num_stages):
                if st not in mine:
                    continue
                first, last = st == 0, st == layout.num_stages - 1
                if not first:
                    x = torch.empty(rows, hidden, device=device, dtype=dtype)
                    dist.recv(x, group=group, group_src=(st - 1) % layout.pp)
                stage = _Stage(module, *mine[st], first=first, last=last, micro_batches=[m], rows=rows,
                               num_label_tokens=1)  # fmt: skip
                x = stage(x, torch.tensor(0))
                route = m.stats["route"].double()
                total = route if total is None else total + route
                if not last:
                    dist.send(x.contiguous(), group=group, group_dst=(st + 1) % layout.pp)
    assert total is not None
    dist.all_reduce(total, group=group)
    return total
