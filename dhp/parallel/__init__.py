"""Parallel strategies applied from outside to a single-device module (see docs/INTERFACES.md).

Each strategy is ``apply_<x>(module, mesh, spec)``; :func:`parallelize` composes them from data.
After backward, every rank of a module group runs ``finalize_grads`` -> ``grad_norm_sq`` ->
``clip_grads_`` -> ``optimizer.step()``. ``CommCounter`` counts collective bytes per step.
"""

from dhp.parallel.ac import AcSpec, apply_ac
from dhp.parallel.comm import CommCounter, CommStats, comm_metrics
from dhp.parallel.compose import MODULE_PLANS, STEPS, ModulePlan, parallelize
from dhp.parallel.dp import Zero1AdamW, allreduce_grads_, partition_params
from dhp.parallel.fsdp import FsdpSpec, apply_fsdp
from dhp.parallel.llm_tp import (
    apply_tp,
    llm_tp_plan,
    local_loss_sum,
    sequence_shard_rows,
    vocab_parallel_loss_sum,
)
from dhp.parallel.optim import build_optimizer, clip_grads_, finalize_grads, grad_norm_sq
from dhp.parallel.param_groups import apply_trainable, set_lr
from dhp.parallel.sp_shard import VisionShard, shard_vision_batch
from dhp.parallel.state import full_grad_dict, full_param_dict, model_state_bytes
from dhp.parallel.ulysses import UlyssesSpec, apply_ulysses_sp, gather_vision_output, reduce_sp_grads
from dhp.parallel.vision_tp import apply_vision_tp, vision_tp_plan

__all__ = [
    "MODULE_PLANS",
    "STEPS",
    "AcSpec",
    "CommCounter",
    "CommStats",
    "FsdpSpec",
    "ModulePlan",
    "UlyssesSpec",
    "VisionShard",
    "Zero1AdamW",
    "allreduce_grads_",
    "apply_ac",
    "apply_fsdp",
    "apply_tp",
    "apply_trainable",
    "apply_ulysses_sp",
    "apply_vision_tp",
    "build_optimizer",
    "clip_grads_",
    "comm_metrics",
    "finalize_grads",
    "full_grad_dict",
    "full_param_dict",
    "gather_vision_output",
    "grad_norm_sq",
    "llm_tp_plan",
    "local_loss_sum",
    "model_state_bytes",
    "parallelize",
    "partition_params",
    "reduce_sp_grads",
    "sequence_shard_rows",
    "set_lr",
    "shard_vision_batch",
    "vision_tp_plan",
    "vocab_parallel_loss_sum",
]
