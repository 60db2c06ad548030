"""The Qwen2.5-VL-style vision encoder's parallel plan by FQN: TP styles and where Ulysses SP attends.

TP: the attention projections column-parallel by heads (a fused ``qkv`` needs
:class:`FusedColwiseParallel`; three Linears ``q``/``k``/``v`` are plain column-parallel), ``proj`` and
the MLP's ``down_proj`` row-parallel (the MLP width 3420 is uneven at TP=8: :class:`UnevenRowwiseParallel`),
the merger column- then row-parallel, so its output is whole on every TP rank. The patch embedding and
the norms stay replicated. Ulysses SP only on the full-attention blocks: window blocks attend inside
windows an SP cut never splits (``sp.py``), so they run locally.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from transformers import PretrainedConfig

from dhp.models.axes import runtime_plan
from dhp.models.family import AttentionSite, ModuleParallelPlan
from dhp.models.qwen2_5_vision.arch import vision_axes
from dhp.parallel.vision_tp import FusedColwiseParallel, UnevenRowwiseParallel


def vision_tp_plan(*, fused_qkv: bool = True) -> dict[str, ParallelStyle]:
    """The encoder TP plan: module FQN glob -> DTensor style (one FQN atom per ``*``).

    Every ``nn.Linear`` of the encoder matches exactly one glob (tested); ``patch_embed.proj`` (Conv3d),
    the norms and ``merger.ln_q`` are left replicated.
    """
    attention: dict[str, ParallelStyle] = (
        {"visual.blocks.*.attn.qkv": FusedColwiseParallel(num_chunks=3)}
        if fused_qkv
        else {f"visual.blocks.*.attn.{p}": ColwiseParallel() for p in ("q", "k", "v")}
    )
    return {
        **attention,
        "visual.blocks.*.attn.proj": RowwiseParallel(),
        "visual.blocks.*.mlp.gate_proj": ColwiseParallel(),
        "visual.blocks.*.mlp.up_proj": ColwiseParallel(),
        "visual.blocks.*.mlp.down_proj": UnevenRowwiseParallel(),
        "visual.merger.mlp.0": ColwiseParallel(),
        "visual.merger.mlp.2": RowwiseParallel(),
    }


def vision_parallel_plan(vision_config: PretrainedConfig, *, fused_qkv: bool = True) -> ModuleParallelPlan:
    """TP by FQN; Ulysses SP on the full-attention blocks where the qkv Linear is fused (the only
    layout ``dhp.parallel.ulysses`` hooks); what each degree must divide is the declared axes'."""
    v = vision_config
    axes = vision_axes(heads=v.num_heads, hidden=v.hidden_size, merge=v.spatial_merge_size, ulysses=fused_qkv)
    return runtime_plan(
        axes,
        blocks=("visual.blocks.*",),
        tp=lambda sequence_parallel: vision_tp_plan(fused_qkv=fused_qkv),
        tp_heads=("visual.blocks.*.attn",),
        sp=tuple(AttentionSite(f"visual.blocks.{i}.attn") for i in v.fullatt_block_indexes),
    )
