"""One validation pass over a composed run config that reports every problem at once.

Each check appends a :class:`~dhp.errors.ConfigIssue` (key path, value, rule, fix) and carries on,
so a user fixes a config in one round trip. :func:`raise_if_invalid` ends in a ConfigError; nothing
has been started at that point. Checks read sub-configs by attribute (no ``.get`` defaults), and
the cross-module rules (placement, cluster fit, routing, batch sizes) live in ``validate_run.py``.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from dhp.config.constants import (
    ATTN_IMPLEMENTATIONS,
    DEVICES,
    DTYPES,
    MIXED_PRECISIONS,
    MODULE_NAMES,
)
from dhp.config.issues import Issues
from dhp.config.validate_data_keys import validate_data_keys
from dhp.config.validate_data_layouts import validate_data_layouts
from dhp.config.validate_guards import validate_guards
from dhp.config.validate_loop import validate_loop
from dhp.config.validate_metrics import validate_metrics
from dhp.config.validate_model_dir import validate_model_dir, validate_tokens
from dhp.config.validate_optimizer import validate_optimizer
from dhp.config.validate_precision import validate_precision
from dhp.errors import ConfigError, ConfigIssue
from dhp.models.graph import known_consumer
from dhp.models.registry import family_names, get_arch
from dhp.validation.validate_capabilities import validate_capabilities
from dhp.validation.validate_finetune import validate_finetune
from dhp.validation.validate_run import validate_data, validate_modules, validate_run
from dhp.validation.validate_trainable import validate_trainable


def _missing(cfg: DictConfig, issues: Issues) -> set[str]:
    """Report ``???`` values; a missing model/cluster is reported once, not per field."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    roots = set()
    for key in missing:
        head = key.split(".")[0]
        whole = head in ("model", "cluster") and OmegaConf.is_missing(cfg[head], "name")
        if whole and key != f"{head}.name":
            continue  # a missing model/cluster is reported once, below
        if key in ("model.name", "cluster.name"):
            roots.add(head)
            issues.add(
                head,
                None,
                f"no {head} selected",
                f"add `- /{head}: NAME` to the recipe's defaults or pass {head}=NAME "
                f"(options in conf/{head}/)",
            )
            continue
        roots.add(key)
        issues.add(key, "???", "mandatory value is missing", f"set {key}=VALUE")
    return roots


def _validate_model(model: DictConfig, device: str, issues: Issues) -> None:
    issues.one_of(model.family, "model.family", tuple(family_names()))
    issues.one_of(model.dtype, "model.dtype", DTYPES)
    if issues.one_of(model.attn_implementation, "model.attn_implementation", ATTN_IMPLEMENTATIONS):
        issues.check(
            not (model.attn_implementation == "flash_attention_2" and device == "cpu"),
            "model.attn_implementation",
            model.attn_implementation,
            "flash_attention_2 needs CUDA but cluster.device is cpu",
            "use model.attn_implementation=sdpa on CPU",
        )
    if model.family in family_names():  # the family validates its own architecture numbers
        get_arch(model.family).validate(model, issues)


def _module_names(cfg: DictConfig, roots: set[str]) -> tuple[str, ...]:
    """The modules of the run's model family (``FamilyArch.module_names``); the vision-language pair
    when the family is missing or unknown (that is its own issue)."""
    if (
        "model" not in roots
        and not OmegaConf.is_missing(cfg.model, "family")
        and cfg.model.family in family_names()
    ):
        return tuple(get_arch(cfg.model.family).module_names)
    return MODULE_NAMES


def _model_types(model: DictConfig) -> tuple[str, ...]:
    """The ``config.json`` model type a family with flavours reads for these numbers (Qwen3.5's MoE
    numbers: ``qwen3_5_moe``), or the ones a family declares (``model_types`` of its arch: a thinker's
    own config and the whole omni model's); empty otherwise (the family's name is its model type)."""
    if model.family not in family_names():
        return ()
    arch = get_arch(model.family)
    flavour = getattr(arch, "flavour", None)  # optional: only families with flavours
    named = tuple(getattr(arch, "model_types", ()))  # optional: families read under other names
    return ((flavour(model).name,) if flavour is not None else ()) + named


def _validate_cluster(cluster: DictConfig, issues: Issues) -> None:
    issues.one_of(cluster.device, "cluster.device", DEVICES)
    issues.positive(
        cluster,
        "cluster",
        [
            "nodes",
            "gpus_per_node",
            "device_memory_gib",
            "peak_bf16_tflops",
            "intra_node_gbps",
            "inter_node_gbps",
            "cpus_per_rank",
        ],
    )


def validate(cfg: DictConfig) -> list[ConfigIssue]:
    """Return every issue of ``cfg`` (empty list: valid). Never raises for a bad value."""
    issues = Issues()
    roots = _missing(cfg, issues)
    validate_guards(cfg, issues)
    if "model" not in roots:
        device = cfg.cluster.device if "cluster" not in roots else "cuda"
        _validate_model(cfg.model, device, issues)
        if cfg.model.llm.vocab_size > 0:
            validate_tokens(cfg.model, issues)
        validate_model_dir(
            cfg.model, issues, real_data=cfg.data.kind == "llava", model_types=_model_types(cfg.model)
        )
    if "cluster" not in roots:
        _validate_cluster(cfg.cluster, issues)
        validate_optimizer(cfg.train, device=cfg.cluster.device, issues=issues)
    validate_metrics(cfg.metrics, issues)
    validate_loop(cfg, issues)
    names = list(cfg.modules.keys())
    known = _module_names(cfg, roots)
    for name in names:
        issues.check(
            name in known,
            f"modules.{name}",
            name,
            f"unknown module; known: {', '.join(known)}",
            "rename the module entry",
        )
    for name in known:
        issues.check(
            name in names,
            f"modules.{name}",
            None,
            f"missing: the model has the modules {', '.join(known)}, each its own group",
            f"add modules.{name} (gpus, parallel) to the recipe, or +modules.{name}.gpus=N",
        )
    if roots & {"model", "cluster"}:
        return issues.items  # the remaining checks need the architecture and the cluster
    validate_modules(cfg, issues)
    validate_precision(cfg, issues)  # mixed_precision keys that cannot take effect
    validate_run(cfg, issues)
    validate_data(cfg, issues)
    validate_data_layouts(cfg.data, issues)
    validate_capabilities(cfg, issues)
    validate_data_keys(cfg, issues, consumer=known_consumer(cfg.model.family))
    validate_trainable(cfg, issues)  # freeze_patterns / param_groups / lora globs against real FQNs
    validate_finetune(cfg, issues)  # run length, LR schedule, evaluation, chat template
    return issues.items


def raise_if_invalid(cfg: DictConfig) -> None:
    """Raise one ConfigError listing every issue of ``cfg``; return silently when valid."""
    issues = validate(cfg)
    if issues:
        raise ConfigError(issues)


__all__ = ["MIXED_PRECISIONS", "Issues", "raise_if_invalid", "validate"]


def is_missing_input(issue: ConfigIssue) -> bool:
    """Whether ``issue`` is one of a run's own inputs missing: ``model.path`` of a model without a
    tiny checkpoint to stand in (for real data), or real data without any dataset. ``dhp plan
    --worst-case`` plans without them (``dhp.runtime.launch.preflight``); ``dhp train`` never does."""
    return (issue.path == "model.path" and issue.value is None) or (
        issue.path == "data.datasets" and issue.value == []
    )
