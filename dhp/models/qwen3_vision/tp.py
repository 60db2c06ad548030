"""TP plan of the Qwen3 vision encoder: module FQN glob -> DTensor style (one FQN atom per ``*``).

The fused qkv is column-parallel in three chunks (q, k, v each split by heads), proj and the MLP's
linear_fc2 row-parallel; the main merger and every DeepStack merger are column- then row-parallel, so
each merger's output (one edge to the LLM) is whole on every TP rank. The patch embedding, the learned
position table and the LayerNorms stay replicated. Per TP rank: 1/tp of every Linear's weight, grad and
optimizer state; the residual stream (rows, hidden) stays whole.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from dhp.models.arch import ModuleAxes
from dhp.models.axes import runtime_plan
from dhp.models.family import AttentionSite, ModuleParallelPlan
from dhp.models.qwen3_vision.arch import QWEN3_VL_MERGERS, MergerNames
from dhp.parallel.vision_tp import FusedColwiseParallel, UnevenRowwiseParallel


def vision_tp_plan(*, deepstack: bool, mergers: MergerNames = QWEN3_VL_MERGERS) -> dict[str, ParallelStyle]:
    """Every ``nn.Linear`` of the encoder matches exactly one glob (tested per family); ``deepstack``:
    whether the encoder has DeepStack mergers; ``mergers``: where its mergers' Linears are
    (``arch.MergerNames``: Qwen3-VL's by default)."""
    plan: dict[str, ParallelStyle] = {
        "visual.blocks.*.attn.qkv": FusedColwiseParallel(num_chunks=3),
        "visual.blocks.*.attn.proj": RowwiseParallel(),
        "visual.blocks.*.mlp.linear_fc1": ColwiseParallel(),
        "visual.blocks.*.mlp.linear_fc2": UnevenRowwiseParallel(),
        f"visual.merger.{mergers.fc1}": ColwiseParallel(),
        f"visual.merger.{mergers.fc2}": RowwiseParallel(),
    }
    if deepstack:
        plan[f"visual.{mergers.deepstack}.*.{mergers.fc1}"] = ColwiseParallel()
        plan[f"visual.{mergers.deepstack}.*.{mergers.fc2}"] = RowwiseParallel()
    return plan


def vision_parallel_plan(
    axes: ModuleAxes, *, deepstack: bool, mergers: MergerNames = QWEN3_VL_MERGERS
) -> ModuleParallelPlan:
    """The encoder's plan: TP by FQN (incl. the DeepStack mergers when ``deepstack``), Ulysses SP on
    every block's attention (heads all-to-all; the rows are cut by ``sp.shard_images``); what each
    degree must divide is the declared ``axes`` (``arch.vision_axes``)."""
    return runtime_plan(
        axes,
        blocks=("visual.blocks.*",),
        tp=lambda sequence_parallel: vision_tp_plan(deepstack=deepstack, mergers=mergers),
        tp_heads=("visual.blocks.*.attn",),
        sp=(AttentionSite("visual.blocks.*.attn"),),
    )
