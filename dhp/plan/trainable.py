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


def _has(module: DictConfig, key: str) -> bool:
    return key in module and module[key] is not None


def trainable_fraction(name: str, *, model: DictConfig, module: DictConfig) -> float:
    """Trainable elements / base parameter elements of module ``name`` (LoRA: adapters / base)."""
    if module.freeze:
        return 0.0
    patterns = list(module.freeze_patterns) if _has(module, "freeze_patterns") else []
    lora_on = _has(module, "lora") and module.lora.rank > 0
    groups = _has(module, "param_groups") and len(module.param_groups) > 0
    if not (patterns or lora_on or groups):
        return 1.0
    key = (name, OmegaConf.to_yaml(model), OmegaConf.to_yaml(module))
    return _count(key)


@functools.lru_cache(maxsize=64)
def _count(key: tuple[str, str, str]) -> float:
    import torch

    from dhp.errors import ConfigError
    from dhp.models import get_family
    from dhp.parallel.lora import named_sizes_with_lora
    from dhp.parallel.param_groups import check_trainable_config, is_lora_param, trainable_names

    name, model_yaml, module_yaml = key
    model, module = OmegaConf.create(model_yaml), OmegaConf.create(module_yaml)
    model.attn_implementation = "sdpa"  # FQNs do not depend on the kernel; flash-attn may be absent here
    family = get_family(model.family)
    built = family.build_module(name, family.hf_config(model), device="meta", dtype=torch.float32)
    sizes = named_sizes_with_lora(built, module_name=name, lora=module.lora)
    issues = check_trainable_config(name, list(sizes), module_cfg=module, lr=1.0)
    if issues:
        raise ConfigError(issues)
    base = sum(v for n, v in sizes.items() if not is_lora_param(n))
    trainable = sum(sizes[n] for n in trainable_names(list(sizes), module_cfg=module))
    return trainable / max(base, 1)
