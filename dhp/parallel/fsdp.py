"""FSDP2 (ZeRO-3 style) for any module: ``fully_shard`` per block, then the root.

Placement: every parameter becomes a DTensor sharded on dim 0 over the ``fsdp`` axis (replicated over
``dp`` when the mesh also has one: HSDP), so each rank keeps 1/fsdp of the parameters, gradients and
(through the optimizer) optimizer states. A block's full parameters exist only between its all-gather
and its reshard. Gradients are reduce-scattered as SUMS (divide factor 1): the loss is already divided
by the step's global label-token count (see INTERFACES "Loss and gradient scaling").

Expert-parallel parameters (:func:`dhp.parallel.ep.expert_params`, DTensors ``Shard(0)`` over the
``ep`` ranks) are left out (``ignored_params``): FSDP neither gathers nor reduces them. They stay
sharded over ``ep`` (1/ep of the experts per rank) and REPLICATED over the ``edp`` ranks (the folded
dp x fsdp x sp ranks outside one EP group); ``finalize_grads`` sums their grads over ``edp``; ZeRO-1
partitions their optimizer states over ``edp`` (``dhp.parallel.dp.Zero1AdamW``). Under expert FSDP
(``parallel.expert_fsdp``, :func:`apply_expert_fsdp`) each experts module is instead an FSDP2 unit of its
own on the ``edp`` axis of the experts' mesh: parameters, gradients and states at 1/(ep x etp x edp),
one MoE layer's local experts all-gathered over ``edp`` while it runs (forward, and again in backward)
and their gradients reduce-scattered (SUM) over ``edp``; the dense units then leave them to it.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from dhp.errors import PlanError
from dhp.parallel.ep import ExpertParallelExperts, expert_params
from dhp.parallel.meshutil import axes
from dhp.parallel.precision import PRECISIONS

#: ``modules.<name>.mixed_precision`` -> FSDP2 policy (None: compute in the parameters' dtype), from
#: the one table of :mod:`dhp.parallel.precision` (bf16 over bf16 parameters casts nothing)
MIXED_PRECISION: dict[str, MixedPrecisionPolicy | None] = {
    name: None
    if p.compute_dtype == torch.float32
    else MixedPrecisionPolicy(param_dtype=p.compute_dtype, reduce_dtype=p.reduce_dtype)
    for name, p in PRECISIONS.items()
}


@dataclass(frozen=True)
class FsdpSpec:
    """Which submodules are FSDP units (FQN globs, one atom per ``*``) and the mixed-precision policy."""

    block_globs: tuple[str, ...]
    mixed_precision: str = "fp32"
    reshard_after_forward: bool = True


def mixed_precision_policy(name: str) -> MixedPrecisionPolicy | None:
    """The FSDP2 policy for a ``mixed_precision`` config value; PlanError names the valid ones."""
    if name not in MIXED_PRECISION:
        raise PlanError(
            f"mixed_precision={name!r} is not one of {sorted(MIXED_PRECISION)}. Fix: pick one of them."
        )
    return MIXED_PRECISION[name]


def _match(fqn: str, glob: str) -> bool:
    a, b = fqn.split("."), glob.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b, strict=True))


def fsdp_blocks(module: nn.Module, globs: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The (FQN, submodule) FSDP units of ``module``, in module order; PlanError when none match."""
    blocks = [(fqn, m) for fqn, m in module.named_modules() if fqn and any(_match(fqn, g) for g in globs)]
    if not blocks:
        raise PlanError(f"no submodule of {type(module).__name__} matches the FSDP block globs {globs}.")
    return blocks


def apply_fsdp(module: nn.Module, mesh: DeviceMesh, spec: FsdpSpec) -> nn.Module:
    """Shard ``module`` in place with FSDP2 over ``mesh``'s (dp, fsdp) axes (HSDP when dp > 1).

    Each block of ``spec.block_globs`` is one unit (all-gathered just before its forward and backward),
    the remaining parameters (embeddings, norms, heads, patch embed) form the root unit.
    """
    shard_mesh = axes(mesh, ("dp", "fsdp"))
    if shard_mesh is None:
        raise PlanError(f"apply_fsdp needs an fsdp axis of degree > 1; mesh axes are {mesh.mesh_dim_names}.")
    policy = mixed_precision_policy(spec.mixed_precision)
    kw = {"mesh": shard_mesh} if policy is None else {"mesh": shard_mesh, "mp_policy": policy}
    owned = {id(p) for m in module.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
    ignored = {p for _, p in expert_params(module) if id(p) not in owned}  # expert FSDP owns the others
    if ignored:
        kw["ignored_params"] = ignored
    for _, block in fsdp_blocks(module, spec.block_globs):
        fully_shard(block, reshard_after_forward=spec.reshard_after_forward, **kw)
    fully_shard(module, reshard_after_forward=False, **kw)
    _sum_reductions(module)
    return module


def _sum_reductions(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # SUM: losses are pre-normalised by the global token count
            m.set_force_sum_reduction_for_comms(True)  # plain SUM op (gloo has no PREMUL_SUM), same on NCCL


def apply_expert_fsdp(module: nn.Module, mixed_precision: str) -> list[nn.Module]:
    """Make every expert-parallel experts module of ``module`` an FSDP2 unit on the ``edp`` axis of its
    experts' mesh (apply after :func:`dhp.parallel.ep.apply_ep`, before the dense :func:`apply_fsdp`).

    Placement: each expert DTensor (``Shard(0)`` over the ``ep`` group) is sharded again over ``edp``,
    on the experts dim when a rank's ``E/(ep x etp)`` experts divide by edp (whole experts per rank),
    else on dim 1 when that divides, else unevenly on the experts dim (FSDP2 pads it); a rank then holds 1/(ep x etp x edp) of the experts' parameters, gradients and
    (through the optimizer) states. Returns the units; PlanError when there is no EP module or edp = 1.
    """
    units = [m for m in module.modules() if isinstance(m, ExpertParallelExperts)]
    if not units and getattr(module, "pipeline_stages", None) is not None:
        return []  # a pipeline stage without MoE blocks: nothing of its own to shard
    if not units or units[0].fold_mesh is None:
        raise PlanError("expert_fsdp: the module has no expert-parallel experts (apply EP first).")
    edp = units[0].fold_mesh["edp"]
    if edp.size() == 1:
        raise PlanError("expert_fsdp needs edp > 1 (the token ranks over ep); set expert_fsdp=false.")
    policy = mixed_precision_policy(mixed_precision)
    kw = {"mesh": edp} if policy is None else {"mesh": edp, "mp_policy": policy}

    def placement(p: nn.Parameter) -> Shard:
        rows, cols = p.to_local().shape[:2]
        if rows % edp.size() and cols % edp.size() == 0:
            return Shard(1)
        return Shard(0)  # whole experts per rank; uneven (FSDP2 pads dim 0) when neither dim divides

    for unit in units:
        fully_shard(unit, reshard_after_forward=True, shard_placement_fn=placement, **kw)
    _sum_reductions(module)
    return units
