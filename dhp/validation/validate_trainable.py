"""Validation of ``modules.<m>.freeze_patterns``, ``param_groups``, ``lora`` and ``export.lora``.

The globs are checked against the module's real FQNs: the model family's module is built on ``meta``
(no memory; only for modules that set any of these), the LoRA adapters' FQNs added, and every glob that
matches nothing, every overlap and every bad value becomes one ConfigIssue, beside the other
validators' issues.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from dhp.config.issues import Issues
from dhp.errors import ConfigError, ConfigIssue
from dhp.layout import module_layout


def needs_trainable_check(module: DictConfig) -> bool:
    """The module sets anything that makes its trainable set differ from "all" or "none":
    ``freeze_patterns``, ``param_groups`` or ``lora`` (rank or targets). The planner's trainable
    fraction and this validation both decide by this."""
    return (
        bool(module.freeze_patterns)
        or bool(module.param_groups)
        or module.lora.rank != 0
        or bool(module.lora.targets)
    )


def trainable_sizes(
    name: str, *, model: DictConfig, module: DictConfig, lr: float
) -> tuple[dict[str, int], list[ConfigIssue]]:
    """``{fqn: elements}`` of module ``name`` built on ``meta`` (LoRA adapters included) and every
    problem of its freeze/param-group/LoRA settings against those FQNs (one rule for validation and
    the planner). FQNs do not depend on the attention kernel: built with sdpa."""
    # Inside the function: torch and the family load only when a module sets freeze/param-group/LoRA
    # globs (validation and the planner's search stay torch-free otherwise), and these are the config ->
    # models/parallel imports that the layers contract lists as its one exception (pyproject.toml).
    import torch

    from dhp.models import get_family
    from dhp.parallel.lora import named_sizes_with_lora
    from dhp.parallel.param_groups import check_trainable_config

    model = OmegaConf.create(OmegaConf.to_container(model, resolve=True))
    model.attn_implementation = "sdpa"
    family = get_family(model.family)
    built = family.build_module(name, family.hf_config(model), device="meta", dtype=torch.float32)
    try:
        sizes = named_sizes_with_lora(built, module_name=name, lora=module.lora)
    except ConfigError as e:
        return {}, list(e.issues)
    return sizes, check_trainable_config(name, list(sizes), module_cfg=module, lr=lr)


def validate_trainable(cfg: DictConfig, issues: Issues) -> None:
    """Add every freeze/param-group/LoRA problem of ``cfg`` to ``issues`` (never raises for a bad value)."""
    issues.one_of(cfg.export.lora, "export.lora", ("merge", "adapter"))
    for name, m in cfg.modules.items():
        # a column-parallel base keeps A replicated over TP: per-rank dropout masks would make its
        # gradient (and then A itself) differ between the TP ranks
        tp = module_layout(m).tp
        issues.check(
            not (m.lora.rank > 0 and m.lora.dropout > 0 and tp > 1),
            f"modules.{name}.lora.dropout",
            m.lora.dropout,
            f"LoRA dropout is not supported with tensor parallelism (modules.{name}.parallel.tp={tp})",
            "set lora.dropout: 0, or shard this module with sp/fsdp/dp instead of tp",
        )
    todo = [(n, m) for n, m in cfg.modules.items() if needs_trainable_check(m)]
    if not todo:
        return
    from dhp.models import get_family  # the declared config -> models exception (pyproject.toml)

    try:
        family = get_family(cfg.model.family)
        family.hf_config(cfg.model)
    except Exception:  # an unknown family or a broken architecture: the model validators report it
        return
    for name, module in todo:
        if name not in family.module_names:
            continue
        _, problems = trainable_sizes(name, model=cfg.model, module=module, lr=cfg.train.lr)
        issues.items.extend(problems)
