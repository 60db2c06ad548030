"""The single-process reference's trainable set and optimizer, made to match the plan's.

``dhp verify`` (and the parity tests) run the unsplit transformers model beside the plan. Each module's
``freeze``, ``freeze_patterns``, ``lora`` and ``param_groups`` are written against MODULE FQNs
(``visual.blocks.0...``); the reference names its parameters by HF keys (``model.visual.blocks.0...``).
``owner`` (HF key -> (module, module FQN), from the family's split) translates, so the reference
freezes, adapts and groups exactly the parameters the plan does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dhp.parallel.optim import impl_kwargs
from dhp.parallel.param_groups import glob_matches, trainable_names


def reference_optimizer(
    model: nn.Module, owner: dict[str, tuple[str, str]], *, modules: dict[str, Any], train: Any
) -> torch.optim.Optimizer:
    """Set ``requires_grad`` as the plan does and build AdamW with the plan's param groups (call after
    ``dhp.parallel.lora.inject_reference_lora``, which extends ``owner`` to the adapters' keys)."""
    by_module: dict[str, list[str]] = {}
    for key, _ in model.named_parameters(remove_duplicate=False):
        by_module.setdefault(owner[key][0], []).append(owner[key][1])
    keep = {m: set(trainable_names(names, module_cfg=modules[m])) for m, names in by_module.items()}
    for key, p in model.named_parameters(remove_duplicate=False):
        m, fqn = owner[key]
        p.requires_grad_(fqn in keep[m])
    groups = [_group(train.lr, train.weight_decay, train.lr)]
    index: dict[tuple[str, int], int] = {}
    for m, cfg in modules.items():
        for i, g in enumerate(cfg.param_groups):
            index[(m, i)] = len(groups)
            lr = train.lr if g.lr is None else g.lr
            groups.append(
                _group(lr, train.weight_decay if g.weight_decay is None else g.weight_decay, train.lr)
            )
    for key, p in model.named_parameters():
        if not p.requires_grad:
            continue
        m, fqn = owner[key]
        pg = modules[m].param_groups
        i = next((i for i, g in enumerate(pg) if glob_matches(fqn, g.match)), None)
        groups[0 if i is None else index[(m, i)]]["params"].append(p)
    return torch.optim.AdamW(
        groups, lr=train.lr, betas=tuple(train.betas), eps=1e-8, **impl_kwargs(train.optimizer.impl)
    )


def _group(lr: float, wd: float, base_lr: float) -> dict:
    return {"params": [], "lr": lr, "weight_decay": wd, "lr_scale": lr / base_lr if base_lr > 0 else 1.0}
