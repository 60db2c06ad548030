"""The planner's trainable set: which share of a module's parameters carries grads and AdamW states.

``freeze_patterns``, ``lora`` and ``freeze`` decide it per parameter (``dhp.parallel.param_groups``).
Counting builds the module on ``meta`` (no memory, the model family's own module; LoRA adapters counted
from the target layers' shapes) once per distinct setting, and checks the globs there, so a glob that matches nothing
is a ConfigError at plan time, before any rank starts. Without any of these settings it costs nothing
(fraction 1, or 0 for ``freeze``).

The fraction multiplies the planner's per-rank gradient and optimizer bytes (``dhp.plan.memory``):
it assumes the trainable parameters shard across TP/FSDP like the module on average (LoRA adapters
are tiny next to the base weights either way).
"""

from __future__ import annotations

import functools

from omegaconf import DictConfig, OmegaConf

from dhp.errors import ConfigError
from dhp.validation.validate_trainable import needs_trainable_check, trainable_sizes


def trainable_fraction(name: str, *, model: DictConfig, module: DictConfig) -> float:
    """Trainable elements / base parameter elements of module ``name`` (LoRA: adapters / base)."""
    if module.freeze:
        return 0.0
    if not needs_trainable_check(module):
        return 1.0
    key = (name, OmegaConf.to_yaml(model), OmegaConf.to_yaml(module))
    return _count(key)


@functools.lru_cache(maxsize=64)
def _count(key: tuple[str, str, str]) -> float:
    from dhp.parallel.param_groups import is_lora_param, trainable_names

    name, model_yaml, module_yaml = key
    model, module = OmegaConf.create(model_yaml), OmegaConf.create(module_yaml)
    sizes, issues = trainable_sizes(name, model=model, module=module, lr=1.0)
    if issues:
        raise ConfigError(issues)
    base = sum(v for n, v in sizes.items() if not is_lora_param(n))
    trainable = sum(sizes[n] for n in trainable_names(list(sizes), module_cfg=module))
    return trainable / max(base, 1)
