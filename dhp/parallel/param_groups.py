"""Which parameters of a module train, and with which optimizer settings: partial freeze and param groups.

Config (per module): ``freeze_patterns: [glob]`` and ``param_groups: [{match: glob, lr, weight_decay}]``.
A glob is matched atom by atom against dot-separated FQNs (``*`` is one atom, fnmatch inside an
atom, ``visual.blocks.1[0-9]``), and a glob that matches a submodule covers every parameter under it.
FQNs are the module's own (``visual.blocks.0.attn.qkv.weight``, ``language_model.layers.0...``);
TP, SP, AC and FSDP2 keep them, so one glob means the same parameters on every plan.

Placement and memory: a frozen parameter keeps ``requires_grad=False``, so it never gets a gradient
(no grad memory, no SP/DP reduction, no FSDP reduce-scatter) and the optimizer never sees it (no
AdamW state). A DTensor (TP/FSDP shard) carries the flag of its parameter, so every rank freezes the
same logical tensors. Groups become the optimizer's param groups; each carries ``lr_scale`` = its LR
over ``train.lr``, and :func:`set_lr` gives every group ``lr * lr_scale``, so the LR schedule scales
all groups alike. The group order is the same on every rank (the default group first, then the
config's order; a group may be empty on a ZeRO-1 rank), so optimizer state dicts line up across ranks.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from dhp.errors import ConfigError, ConfigIssue

#: substrings of the FQNs of peft's LoRA adapter parameters (``q_proj.lora_A.default.weight``)
LORA_PARAM_MARKERS = (".lora_A.", ".lora_B.")


def glob_matches(fqn: str, glob: str) -> bool:
    """True when ``glob`` matches ``fqn`` or one of its submodule prefixes, one atom per ``*``."""
    a, b = fqn.split("."), glob.split(".")
    return len(b) <= len(a) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b, strict=False))


def is_lora_param(fqn: str) -> bool:
    """True for a peft LoRA adapter parameter (the A/B matrices)."""
    return any(m in fqn for m in LORA_PARAM_MARKERS)


def trainable_names(names: Iterable[str], *, module_cfg: Any) -> list[str]:
    """Pure: the parameter FQNs that train under ``module_cfg`` (freeze, LoRA, freeze_patterns)."""
    if module_cfg.freeze:
        return []
    lora_on = module_cfg.lora.rank > 0
    out = []
    for n in names:
        if lora_on and not is_lora_param(n):
            continue
        if any(glob_matches(n, g) for g in module_cfg.freeze_patterns):
            continue
        out.append(n)
    return out


def check_trainable_config(
    module_name: str, names: Sequence[str], *, module_cfg: Any, lr: float
) -> list[ConfigIssue]:
    """Every problem with ``modules.<module_name>``'s freeze/group settings against its parameter FQNs."""
    key = f"modules.{module_name}"
    issues: list[ConfigIssue] = []
    groups = list(module_cfg.param_groups)
    if module_cfg.freeze and (module_cfg.freeze_patterns or groups or module_cfg.lora.rank > 0):
        issues.append(ConfigIssue(f"{key}.freeze", True, "a frozen module trains nothing: freeze_patterns, "
                                  "param_groups and lora have no effect", "drop them or set freeze: false"))  # fmt: skip
    for i, g in enumerate(module_cfg.freeze_patterns):
        if not any(glob_matches(n, g) for n in names):
            issues.append(_no_match(f"{key}.freeze_patterns[{i}]", g, names))
    trainable = trainable_names(names, module_cfg=module_cfg)
    if names and not trainable and not module_cfg.freeze:
        issues.append(ConfigIssue(f"{key}.freeze_patterns", list(module_cfg.freeze_patterns),
                                  "freezes every parameter of the module", "use freeze: true for that"))  # fmt: skip
    owner: dict[str, int] = {}
    for i, g in enumerate(groups):
        path = f"{key}.param_groups[{i}]"
        if not g.match:
            issues.append(
                ConfigIssue(f"{path}.match", g.match, "must be a non-empty FQN glob", "e.g. visual.merger")
            )
            continue
        if g.lr is not None and not (math.isfinite(g.lr) and g.lr > 0):
            issues.append(
                ConfigIssue(
                    f"{path}.lr", g.lr, "must be a finite number > 0", "e.g. 1e-5, or null for train.lr"
                )
            )
        if g.lr is not None and lr <= 0:
            issues.append(ConfigIssue("train.lr", lr, "must be > 0 when a param group sets its own lr "
                                      "(the schedule scales groups by lr / train.lr)", "set train.lr > 0"))  # fmt: skip
        if g.weight_decay is not None and not (math.isfinite(g.weight_decay) and g.weight_decay >= 0):
            issues.append(
                ConfigIssue(f"{path}.weight_decay", g.weight_decay, "must be >= 0", "e.g. 0.0 or 0.1")
            )
        hits = [n for n in trainable if glob_matches(n, g.match)]
        if not hits:
            issues.append(_no_match(f"{path}.match", g.match, trainable, what="trainable parameter"))
        for n in hits:
            if n in owner:
                j = owner[n]
                issues.append(ConfigIssue(f"{path}.match", g.match, f"overlaps param_groups[{j}].match="
                                          f"{groups[j].match!r} (both match {n})", "make the globs disjoint"))  # fmt: skip
                break
            owner[n] = i
    return issues


def _no_match(path: str, glob: str, names: Sequence[str], *, what: str = "parameter") -> ConfigIssue:
    sample = sorted({".".join(n.split(".")[:3]) for n in names})[:6]
    return ConfigIssue(path, glob, f"matches no {what} of the module (globs match dot-separated FQN atoms, "
                       f"'*' = one atom)", f"pick FQNs such as {sample}")  # fmt: skip


def apply_trainable(module: nn.Module, *, module_name: str, module_cfg: Any, lr: float) -> None:
    """Set ``requires_grad`` of every parameter of ``module`` (real, meta, DTensor or FSDP2 shards).

    Raises ConfigError (all problems at once) when a glob matches nothing, groups overlap or values
    are out of range. Idempotent; call it after ``parallelize`` (styles that re-create parameters
    do not always carry the flag over).
    """
    names = [n for n, _ in module.named_parameters()]
    issues = check_trainable_config(module_name, names, module_cfg=module_cfg, lr=lr)
    if issues:
        raise ConfigError(issues)
    keep = set(trainable_names(names, module_cfg=module_cfg))
    for n, p in module.named_parameters():
        p.requires_grad_(n in keep)


def optimizer_groups(module: nn.Module, *, param_groups: Sequence[Any], train: Any) -> list[dict]:
    """The optimizer's param groups over the trainable parameters of ``module``.

    Group 0 holds every trainable parameter no ``param_groups`` glob matches (``train.lr``,
    ``train.weight_decay``); group ``i+1`` the ones ``param_groups[i]`` matches. Each dict has
    ``params``, ``lr``, ``weight_decay``, ``lr_scale`` (lr / train.lr) and ``name`` (the glob).
    """
    out = [_group("default", train.lr, train.weight_decay, train.lr)]
    for g in param_groups:
        lr = train.lr if g.lr is None else g.lr
        wd = train.weight_decay if g.weight_decay is None else g.weight_decay
        out.append(_group(g.match, lr, wd, train.lr))
    for n, p in module.named_parameters():
        if not p.requires_grad:
            continue
        idx = next((i + 1 for i, g in enumerate(param_groups) if glob_matches(n, g.match)), 0)
        out[idx]["params"].append(p)
    return out


def _group(name: str, lr: float, wd: float, base_lr: float) -> dict:
    scale = lr / base_lr if base_lr > 0 else 1.0
    return {"params": [], "lr": lr, "weight_decay": wd, "lr_scale": scale, "name": name}


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's LR for this step, scaled per group (``lr * lr_scale``; 1 for plain groups)."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g["lr_scale"] if "lr_scale" in g else lr
