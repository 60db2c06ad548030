"""Parallel strategies applied from outside to a single-device module (see docs/INTERFACES.md).

Each strategy is ``apply_<x>(module, mesh, spec)``; :func:`parallelize` composes them from the data
plan a model family attached to the module (``module.parallel_plan``). After backward, every rank of
a module group runs ``finalize_grads`` -> ``grad_norm_sq`` -> ``clip_grads_`` -> ``optimizer.step()``.
``CommCounter`` counts collective bytes per step. Nothing here names a model family.
"""

from dhp.parallel.ac import AcSpec, apply_ac
from dhp.parallel.comm import CommCounter, CommStats, comm_metrics
from dhp.parallel.compose import STEPS, parallelize
from dhp.parallel.dp import Zero1AdamW, allreduce_grads_, partition_params
from dhp.parallel.expert_load import ExpertLoad, expert_load_paused, track_expert_load
from dhp.parallel.fsdp import FsdpSpec, apply_fsdp
from dhp.parallel.llm_tp import (
    VocabParallelEmbedding,
    apply_tp,
    check_divides,
    decoder_tp_plan,
    local_loss_sum,
    sequence_shard_rows,
    vocab_parallel_loss_sum,
)
from dhp.parallel.meshutil import build_mesh, inner_group
from dhp.parallel.optim import build_optimizer, clip_grads_, finalize_grads, grad_norm_sq
from dhp.parallel.param_groups import apply_trainable, set_lr
from dhp.parallel.pipeline import over_pipeline
from dhp.parallel.plan_match import match_plan
from dhp.parallel.precision import (
    PRECISIONS,
    Precision,
    cast_parameters_,
    check_device_computes,
    precision_of,
)
from dhp.parallel.state import full_grad_dict, full_param_dict, model_state_bytes
from dhp.parallel.ulysses import (
    UlyssesSpec,
    apply_ulysses_sp,
    gather_sp_output,
    module_plan,
    reduce_sp_grads,
)
from dhp.parallel.vision_tp import FusedColwiseParallel, UnevenRowwiseParallel

__all__ = [
    "PRECISIONS",
    "STEPS",
    "AcSpec",
    "CommCounter",
    "CommStats",
    "ExpertLoad",
    "FsdpSpec",
    "FusedColwiseParallel",
    "Precision",
    "UlyssesSpec",
    "UnevenRowwiseParallel",
    "VocabParallelEmbedding",
    "Zero1AdamW",
    "allreduce_grads_",
    "apply_ac",
    "apply_fsdp",
    "apply_tp",
    "apply_trainable",
    "apply_ulysses_sp",
    "build_mesh",
    "build_optimizer",
    "cast_parameters_",
    "check_device_computes",
    "check_divides",
    "clip_grads_",
    "comm_metrics",
    "decoder_tp_plan",
    "expert_load_paused",
    "finalize_grads",
    "full_grad_dict",
    "full_param_dict",
    "gather_sp_output",
    "grad_norm_sq",
    "inner_group",
    "local_loss_sum",
    "match_plan",
    "model_state_bytes",
    "module_plan",
    "over_pipeline",
    "parallelize",
    "partition_params",
    "precision_of",
    "reduce_sp_grads",
    "sequence_shard_rows",
    "set_lr",
    "track_expert_load",
    "vocab_parallel_loss_sum",
]
