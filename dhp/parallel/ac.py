"""Activation checkpointing per module, through transformers' own ``activation_checkpointing_enable``.

Modes (parsed by ``dhp.config.ac.parse_ac_mode``; :class:`AcSpec` holds the result):

- ``full``: every decoder layer / vision block keeps only its input during forward and recomputes
  everything in backward (non-reentrant ``torch.utils.checkpoint``): saved activations drop from
  O(layers x tokens x hidden x per-layer factor) to O(layers x tokens x hidden) plus one layer's worth;
  recompute = one extra forward of every layer.
- ``every_n:K``: only every K-th layer is checkpointed; the others keep their activations.
- ``selective``: op-level, as torchtitan's: every layer runs under a selective-checkpoint context
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) whose policy SAVES the outputs of
  the matmuls, of attention and of the sequence-parallel collectives (:data:`SELECTIVE_SAVE`) and
  recomputes the cheap element-wise ops between them (norms, activations, rotary, residual adds,
  casts). Memory: the matmul outputs of every layer (roughly a third to a half of ``off``'s);
  recompute: element-wise ops only, no matmul FLOPs and no collective repeated.

Parameter FQNs are unchanged (no wrapper modules), so checkpoints and parity keys stay the same.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from dhp.errors import PlanError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

#: ops whose outputs the selective mode keeps (everything else is recomputed in backward)
SELECTIVE_SAVE: frozenset = frozenset(
    op
    for op in (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten.linear.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        getattr(_c10d, "reduce_scatter_tensor", None) and _c10d.reduce_scatter_tensor.default,
        getattr(_c10d, "all_gather_into_tensor", None) and _c10d.all_gather_into_tensor.default,
        getattr(_c10d, "all_reduce", None) and _c10d.all_reduce.default,
    )
    if op
)


@dataclass(frozen=True)
class AcSpec:
    """``kind`` full | every_n | selective; ``every_n_layers``: checkpoint every K-th layer (1 = all)."""

    kind: str = "full"
    every_n_layers: int = 1


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep the outputs of matmuls, attention and collectives; recompute every other op."""
    return CheckpointPolicy.MUST_SAVE if op in SELECTIVE_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


#: callables told of each selective region's cache as the region starts (``dhp.metrics.accounting``
#: counts the outputs it keeps, which autograd's saved-tensor hooks never see)
CACHE_OBSERVERS: list[Callable[[object], None]] = []


def selective_context():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: the selective (op-level) policy. Each
    observer in :data:`CACHE_OBSERVERS` gets the region's recompute context, whose ``storage`` holds
    the kept outputs until backward consumes them (torch's ``_CachedTorchDispatchMode``; it lives as
    long as the region's graph)."""
    caching, cached = create_selective_checkpoint_contexts(_selective_policy)
    for observe in CACHE_OBSERVERS:
        observe(cached)
    return caching, cached


def _outermost_pretrained(module: nn.Module) -> list[PreTrainedModel]:
    # reason: transformers' modeling_utils costs ~2.5 CPU-s to import; the driver imports this
    # package (for plans and the worker class) but never applies AC, so only a rank pays for it
    from transformers import PreTrainedModel

    found: list[PreTrainedModel] = []
    for m in module.modules():
        if isinstance(m, PreTrainedModel) and not any(m in f.modules() for f in found):
            found.append(m)
    return found


def checkpoint_kwargs(spec: AcSpec) -> dict:
    """The keyword arguments every checkpointed layer passes to ``torch.utils.checkpoint.checkpoint``."""
    if spec.kind not in ("full", "every_n", "selective"):
        raise PlanError(
            f"activation checkpointing kind {spec.kind!r} is not one of full, every_n, selective."
        )
    kwargs: dict = {"use_reentrant": False}
    if spec.kind == "selective":
        kwargs["context_fn"] = functools.partial(selective_context)
    return kwargs


def apply_ac(module: nn.Module, mesh: DeviceMesh | None, spec: AcSpec) -> nn.Module:
    """Turn on activation checkpointing (``spec``) in every transformers model inside ``module``, in place.

    ``mesh`` is unused (the signature is uniform across strategies). PlanError when ``module`` holds no
    transformers model that supports it.
    """
    del mesh
    models = [m for m in _outermost_pretrained(module) if m.supports_gradient_checkpointing]
    if not models:
        raise PlanError(
            f"activation_checkpointing is on but {type(module).__name__} holds no transformers model that "
            "supports it. Fix: set modules.<name>.activation_checkpointing=off."
        )
    kwargs = checkpoint_kwargs(spec)
    every_n = spec.every_n_layers if spec.kind == "every_n" else 1
    for m in models:
        m.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n)
    return module
