"""Activation checkpointing per module, through transformers' own ``activation_checkpointing_enable``.

Each checkpointed decoder layer / vision block keeps only its input during forward and recomputes its
activations in backward (non-reentrant ``torch.utils.checkpoint``): activation memory drops from
O(layers x tokens x hidden x per-layer factor) to O(layers x tokens x hidden) plus one layer's worth.
Parameter FQNs are unchanged (no wrapper modules), so checkpoints and parity keys stay the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import PreTrainedModel

from dhp.errors import PlanError


@dataclass(frozen=True)
class AcSpec:
    """Checkpoint every ``every_n_layers``-th layer (1 = all of them)."""

    every_n_layers: int = 1


def _outermost_pretrained(module: nn.Module) -> list[PreTrainedModel]:
    found: list[PreTrainedModel] = []
    for m in module.modules():
        if isinstance(m, PreTrainedModel) and not any(m in f.modules() for f in found):
            found.append(m)
    return found


def apply_ac(module: nn.Module, mesh: DeviceMesh | None, spec: AcSpec) -> nn.Module:
    """Turn on activation checkpointing in every transformers model inside ``module``, in place.

    ``mesh`` is unused (the signature is uniform across strategies). PlanError when ``module`` holds no
    transformers model that supports it.
    """
    del mesh
    models = [m for m in _outermost_pretrained(module) if m.supports_gradient_checkpointing]
    if not models:
        raise PlanError(
            f"activation_checkpointing is on but {type(module).__name__} holds no transformers model that "
            "supports it. Fix: set modules.<name>.activation_checkpointing=false."
        )
    for m in models:
        m.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=spec.every_n_layers
        )
    return module
