"""Expert-load statistics of a module's sparse-MoE layers: tokens per expert, per layer, per step.

:func:`track_expert_load` puts a forward pre-hook on the ``experts`` child of every MoE block (the
transformers module, or :class:`~dhp.parallel.ep.ExpertParallelExperts` after EP: both are called
as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``). The hook adds
``bincount(top_k_index)`` to a per-layer ``[L, E]`` int64 counter on the device: the router's top-k
assignments, i.e. the tokens each expert computes (dropless, so this is exactly its work). A
forward re-run by activation checkpointing inside backward is not counted twice.

:meth:`ExpertLoad.take` (collective over the module's world, once per step) sums the counters over
the ranks that see different tokens (the whole world, divided by the tp degree whose ranks route
the same tokens), summarises them and resets. A forward that is not the step's training forward (the
runtime's step-statistics pass, without gradient) runs under :func:`expert_load_paused`. Memory: ``L * E`` int64 per rank; one all-reduce of
that size per step.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dhp.errors import PlanError


@dataclass(frozen=True)
class LoadSummary:
    """One step's expert load over the module's MoE layers (all ranks' tokens).

    ``max``/``mean``: tokens per expert of the worst layer (highest ``max / mean``), ``worst_layer``
    its index among the MoE layers; ``max_over_mean`` that ratio (1.0 = perfectly balanced,
    ``E / top_k`` = every token's top-k on the same experts); ``per_layer``: the ratio of every layer.
    """

    layers: int
    experts: int
    max: float
    mean: float
    max_over_mean: float
    worst_layer: int
    per_layer: tuple[float, ...]

    def as_record(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` form (``expert_load.<module>``)."""
        return {
            "tokens_per_expert_max": self.max,
            "tokens_per_expert_mean": self.mean,
            "max_over_mean": self.max_over_mean,
            "worst_layer": self.worst_layer,
            "layers": self.layers,
        }


def summarize(counts: torch.Tensor) -> LoadSummary:
    """Pure: :class:`LoadSummary` of a ``[layers, experts]`` tokens-per-expert table."""
    c = counts.double().cpu()
    mean = c.mean(dim=1)
    peak = c.max(dim=1).values
    ratio = torch.where(mean > 0, peak / mean.clamp_min(1e-12), torch.ones_like(mean))
    worst = int(torch.argmax(ratio))
    return LoadSummary(
        layers=c.shape[0],
        experts=c.shape[1],
        max=float(peak[worst]),
        mean=float(mean[worst]),
        max_over_mean=float(ratio[worst]),
        worst_layer=worst,
        per_layer=tuple(float(r) for r in ratio),
    )


class ExpertLoad:
    """The per-layer counters of one module and the hooks that fill them (see the module docstring)."""

    def __init__(
        self,
        experts: list[nn.Module],
        num_experts: int,
        *,
        duplicates: int,
        rows: list[int] | None = None,
        table_rows: int | None = None,
    ) -> None:
        self.num_experts = num_experts
        self.duplicates = duplicates  # ranks that route the same tokens (the tp degree)
        self.counts: torch.Tensor | None = None
        # pipeline stages: each rank counts its blocks' rows of one table over every layer of the model
        # (``rows``: each block's row, ``table_rows``: the table's); the rows no stage counted are dropped
        self.layers = len(experts) if table_rows is None else table_rows
        self.sparse_table = table_rows is not None
        self.paused = False  # True: forwards are not counted (expert_load_paused)
        for i, m in zip(rows if rows is not None else range(len(experts)), experts, strict=True):
            m.register_forward_pre_hook(self._hook(i))

    def _hook(self, layer: int):
        def count(_module: nn.Module, args: tuple[Any, ...]) -> None:
            if torch._C._current_graph_task_id() != -1:  # a recompute inside backward (AC): counted once
                return
            if self.paused:
                return
            top_k_index = args[1]
            if self.counts is None:
                self.counts = torch.zeros(
                    self.layers, self.num_experts, dtype=torch.int64, device=top_k_index.device
                )
            self.counts[layer] += torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts)

        return count

    def take(self, *, device: torch.device) -> LoadSummary | None:
        """Sum this step's counters over the world (collective), summarise, reset. None before any
        forward on every rank (a producer-only step, a frozen step that never ran the MoE layers)."""
        counts = self.counts
        if counts is None:
            counts = torch.zeros(self.layers, self.num_experts, dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        self.counts = None
        if int(counts.sum()) == 0:
            return None
        if self.sparse_table:  # the dense layers' rows (no stage's MoE block counts them)
            counts = counts[counts.sum(dim=1) > 0]
        return summarize(counts // self.duplicates)


def track_expert_load(
    module: nn.Module,
    block_glob: str,
    *,
    duplicates: int = 1,
    experts_attr: str = "experts",
    num_experts: int = 0,
) -> ExpertLoad:
    """Hook the ``experts_attr`` child of every block matching ``block_glob`` (in module order).

    Call after ``parallelize`` (EP swaps the experts module). ``duplicates``: ranks of the world
    that route the same tokens (the module's tp degree). PlanError when no block matches, except on a
    pipeline stage (``module.pipeline_stages``), which may hold none: its table has a row per decoder
    layer of the whole model (the block's layer index in its FQN), summed over the stages, and
    ``num_experts`` (the family's count) sizes it.
    """
    found = [
        (fqn, getattr(sub, experts_attr))
        for fqn, sub in module.named_modules()
        if fnmatch.fnmatchcase(fqn, block_glob) and hasattr(sub, experts_attr)
    ]
    blocks = [b for _, b in found]
    staged = getattr(module, "pipeline_stages", None) is not None
    if not blocks and not staged:
        raise PlanError(f"expert load: no module matches block glob {block_glob!r} with `{experts_attr}`.")
    if blocks:
        num_experts = int(blocks[0].gate_up_proj.shape[0])  # the global count (a DTensor's shape is global)
    if not staged:
        return ExpertLoad(blocks, num_experts, duplicates=duplicates)
    rows = [_layer_index(fqn) for fqn, _ in found]
    table = int(module.language_model.config.num_hidden_layers)
    return ExpertLoad(blocks, num_experts, duplicates=duplicates, rows=rows, table_rows=table)


def _layer_index(fqn: str) -> int:
    """The decoder-layer index in a block's FQN (its first integer part: ``...layers.12.mlp`` -> 12)."""
    for part in fqn.split("."):
        if part.isdigit():
            return int(part)
    raise PlanError(f"expert load: block {fqn!r} has no layer index in its name")


@contextlib.contextmanager
def expert_load_paused(load: ExpertLoad | None) -> Iterator[None]:
    """Inside the block, ``load``'s hooks count nothing (a no-op for None)."""
    if load is None:
        yield
        return
    load.paused = True
    try:
        yield
    finally:
        load.paused = False
