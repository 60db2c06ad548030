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
    FAMILIES,
    MIXED_PRECISIONS,
    MODULE_NAMES,
    REQUIRED_MODULES,
)
from dhp.config.issues import Issues
from dhp.config.validate_guards import validate_guards
from dhp.config.validate_metrics import validate_metrics
from dhp.config.validate_model_dir import validate_model_dir, validate_tokens
from dhp.config.validate_run import validate_data, validate_modules, validate_run
from dhp.config.validate_trainable import validate_trainable
from dhp.errors import ConfigError, ConfigIssue


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
    issues.one_of(model.family, "model.family", FAMILIES)
    issues.one_of(model.dtype, "model.dtype", DTYPES)
    if issues.one_of(model.attn_implementation, "model.attn_implementation", ATTN_IMPLEMENTATIONS):
        issues.check(
            not (model.attn_implementation == "flash_attention_2" and device == "cpu"),
            "model.attn_implementation",
            model.attn_implementation,
            "flash_attention_2 needs CUDA but cluster.device is cpu",
            "use model.attn_implementation=sdpa on CPU",
        )
    _validate_vision_arch(model.vision, issues)
    _validate_llm_arch(model.llm, issues)


_VISION_SIZES = [
    "depth",
    "hidden_size",
    "num_heads",
    "intermediate_size",
    "patch_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "window_size",
    "in_channels",
]


def _validate_vision_arch(v: DictConfig, issues: Issues) -> None:
    issues.positive(v, "model.vision", _VISION_SIZES)
    if v.num_heads > 0:
        issues.check(
            v.hidden_size % v.num_heads == 0,
            "model.vision.hidden_size",
            v.hidden_size,
            f"must be divisible by model.vision.num_heads={v.num_heads}",
            "pick a head count that divides the hidden size",
        )
    unit = v.patch_size * v.spatial_merge_size
    if unit > 0:
        issues.check(
            v.window_size % unit == 0,
            "model.vision.window_size",
            v.window_size,
            f"must be a multiple of patch_size*spatial_merge_size={unit}",
            f"use a multiple of {unit}",
        )
    bad = [i for i in v.fullatt_block_indexes if not 0 <= i < v.depth]
    issues.check(
        not bad,
        "model.vision.fullatt_block_indexes",
        list(v.fullatt_block_indexes),
        f"indexes {bad} outside [0, depth={v.depth})",
        "list block indexes smaller than model.vision.depth",
    )


def _validate_llm_arch(lm: DictConfig, issues: Issues) -> None:
    issues.positive(
        lm,
        "model.llm",
        ["hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"],
    )
    if lm.num_heads > 0 and lm.num_kv_heads > 0:
        ok_h = issues.check(
            lm.hidden_size % lm.num_heads == 0,
            "model.llm.hidden_size",
            lm.hidden_size,
            f"must be divisible by model.llm.num_heads={lm.num_heads}",
            "pick a head count that divides the hidden size",
        )
        issues.check(
            lm.num_heads % lm.num_kv_heads == 0,
            "model.llm.num_kv_heads",
            lm.num_kv_heads,
            f"must divide model.llm.num_heads={lm.num_heads} (grouped-query attention)",
            "pick a KV head count that divides the head count",
        )
        if ok_h:
            half = lm.hidden_size // lm.num_heads // 2
            issues.check(
                sum(lm.mrope_section) == half,
                "model.llm.mrope_section",
                list(lm.mrope_section),
                f"must sum to head_dim/2 = {half}",
                "use the published [16, 24, 24] for head_dim 128",
            )


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
        validate_model_dir(cfg.model, issues)
    if "cluster" not in roots:
        _validate_cluster(cfg.cluster, issues)
    validate_metrics(cfg.metrics, issues)
    names = list(cfg.modules.keys())
    for name in names:
        issues.check(
            name in MODULE_NAMES,
            f"modules.{name}",
            name,
            f"unknown module; known: {', '.join(MODULE_NAMES)}",
            "rename the module entry",
        )
    for name in REQUIRED_MODULES:
        issues.check(
            name in names,
            f"modules.{name}",
            None,
            "missing: a vision-language model needs both modules",
            f"add modules.{name} (gpus, parallel) to the recipe, or +modules.{name}.gpus=N",
        )
    if roots & {"model", "cluster"}:
        return issues.items  # the remaining checks need the architecture and the cluster
    validate_modules(cfg, issues)
    validate_run(cfg, issues)
    validate_data(cfg, issues)
    validate_trainable(cfg, issues)  # freeze_patterns / param_groups / lora globs against real FQNs
    return issues.items


def raise_if_invalid(cfg: DictConfig) -> None:
    """Raise one ConfigError listing every issue of ``cfg``; return silently when valid."""
    issues = validate(cfg)
    if issues:
        raise ConfigError(issues)


__all__ = ["MIXED_PRECISIONS", "Issues", "raise_if_invalid", "validate"]
