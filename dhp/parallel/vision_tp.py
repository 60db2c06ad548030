"""Tensor parallelism for the Qwen2.5-VL vision encoder (the uniform-TP baseline), as a plan of DTensor styles.

Placement after :func:`apply_vision_tp` on a TP group of N ranks:
- ``blocks.*.attn.qkv`` (fused, rows laid out q|k|v): ``_StridedShard(0, split_factor=3)``. Rank r holds
  rows ``[q_r; k_r; v_r]`` (its H/N heads of each), while the logical full tensor is exactly transformers'
  (q|k|v), so DCP checkpoints reshard between TP and non-TP. A plain ``Shard(0)`` would give rank 0 all
  of q and be wrong. The attention's ``num_heads`` is set to H/N, so transformers' own attention forward
  runs unchanged on the local heads;
- ``blocks.*.attn.proj``, ``blocks.*.mlp.down_proj``, ``merger.mlp.2``: row-parallel (``Shard(1)``), output
  all-reduced to a replicated hidden state;
- ``blocks.*.mlp.{gate,up}_proj``, ``merger.mlp.0``: column-parallel (``Shard(0)``); the MLP width may be
  uneven across ranks (torch.chunk sizes), e.g. Qwen2.5-VL's 3420 at TP=8, see :class:`UnevenRowwiseParallel`;
- ``patch_embed`` (a Conv3d), norms and ``merger.ln_q``: replicated; their inputs' gradients are
  all-reduced by the column-parallel styles, so their grads are complete and identical on every rank.

Memory per rank: the Linear weights, grads and optimizer states are 1/N; activations inside attention
and the MLPs are 1/N, the residual stream (L, D) stays replicated.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from dhp.errors import ConfigError, ConfigIssue
from dhp.parallel.ulysses import find_vision_model


class FusedColwiseParallel(ColwiseParallel):
    """Column-parallel for a Linear whose output rows are ``num_chunks`` fused blocks (q|k|v).

    Weight and bias become ``_StridedShard(0, split_factor=num_chunks)``: rank r holds the r-th 1/N of
    every block, contiguous, so its local output is ``[q_r | k_r | v_r]``. Input: replicated (its
    gradient is all-reduced); output: the local (…, num_chunks*out/N) tensor.
    """

    def __init__(self, *, num_chunks: int = 3) -> None:
        super().__init__()
        self.num_chunks = num_chunks

    def _partition_linear_fn(self, name, module, device_mesh):  # type: ignore[override]
        for pname, param in module.named_parameters():
            placement = _StridedShard(0, split_factor=self.num_chunks)
            dist_param = nn.Parameter(
                distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(pname, dist_param)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # type: ignore[override]
        (placement,) = outputs.placements
        if not isinstance(placement, _StridedShard) or placement.dim not in (-1, outputs.ndim - 1):
            raise RuntimeError(
                f"fused column-parallel output has placement {placement}; expected strided last dim"
            )
        return outputs.to_local()


class UnevenRowwiseParallel(RowwiseParallel):
    """Row-parallel Linear whose input features may not divide by N (torch.chunk sizes: ceil, last smaller).

    The stock style infers the input's global width as ``local * N``, which is wrong for uneven shards;
    here the global shape comes from the (already distributed) weight, so e.g. the encoder MLP width
    3420 runs at TP=8 (seven ranks 428, one 424). Output: all-reduced, replicated.
    """

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):  # type: ignore[override]
        x = inputs[0]
        if isinstance(x, DTensor):
            return x
        shape = torch.Size((*x.shape[:-1], mod.weight.shape[1]))
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(x, device_mesh, input_layouts, run_check=False, shape=shape, stride=stride)


def vision_tp_plan() -> dict[str, ParallelStyle]:
    """The encoder TP plan: module FQN glob -> DTensor style (one FQN atom per ``*``).

    Every ``nn.Linear`` of the encoder matches exactly one glob (tested); ``patch_embed.proj`` (Conv3d),
    the norms and ``merger.ln_q`` are left replicated.
    """
    return {
        "visual.blocks.*.attn.qkv": FusedColwiseParallel(num_chunks=3),
        "visual.blocks.*.attn.proj": RowwiseParallel(),
        "visual.blocks.*.mlp.gate_proj": ColwiseParallel(),
        "visual.blocks.*.mlp.up_proj": ColwiseParallel(),
        "visual.blocks.*.mlp.down_proj": UnevenRowwiseParallel(),
        "visual.merger.mlp.0": ColwiseParallel(),
        "visual.merger.mlp.2": RowwiseParallel(),
    }


def check_vision_tp_divisibility(*, num_heads: int, merger_hidden: int, tp: int) -> None:
    """Raise ConfigError (before any forward) when ``tp`` does not divide a sharded encoder dimension.

    The MLP width need not divide (uneven shards, :class:`UnevenRowwiseParallel`); heads and the merger
    width must.
    """
    dims = {"num_heads": num_heads, "merger hidden": merger_hidden}
    issues = [
        ConfigIssue(
            "modules.vision.parallel.tp", tp, f"must divide the vision encoder's {dim}={size}",
            "pick a tp that divides it, or use sp for the encoder",
        )
        for dim, size in dims.items()
        if size % tp
    ]  # fmt: skip
    if issues:
        raise ConfigError(issues)


def _tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D TP sub-mesh (``mesh['tp']`` when named, else the 1-D mesh itself)."""
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        return mesh["tp"]
    if mesh.ndim == 1:
        return mesh
    raise ConfigError(
        [
            ConfigIssue(
                "modules.vision.parallel.tp", names, "mesh has no 'tp' axis", "build the mesh with a tp axis"
            )
        ]
    )


def apply_vision_tp(
    module: nn.Module, mesh: DeviceMesh, spec: Mapping[str, ParallelStyle] | None = None
) -> nn.Module:
    """Shard the vision module in place over the TP axis of ``mesh`` by ``spec`` (default :func:`vision_tp_plan`).

    FQNs are unchanged; planned weights become DTensors (1/N per rank), and each attention's
    ``num_heads`` becomes H/N. Raises ConfigError when N does not divide the heads or the merger width.
    """
    tp_mesh = _tp_mesh(mesh)
    tp = tp_mesh.size()
    visual = find_vision_model(module)
    cfg = visual.config
    check_vision_tp_divisibility(
        num_heads=cfg.num_heads,
        merger_hidden=visual.merger.hidden_size,
        tp=tp,
    )
    if tp == 1:
        return module
    parallelize_module(module, tp_mesh, dict(spec) if spec is not None else vision_tp_plan())
    for block in visual.blocks:
        if isinstance(block.attn.qkv.weight, DTensor):
            block.attn.num_heads = cfg.num_heads // tp
    return module
