"""Guards against numbers and names that make no sense, whatever the recipe.

Every float anywhere in the config must be finite (``inf``/``nan`` from an override would poison
the schedule or a timeout); timeouts and restart waits must be positive; the run name becomes a
directory under ``train.output_dir`` and must be one plain path component.
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from dhp.config.issues import Issues

_TRAIN_POSITIVE = ("step_timeout_s", "restart_wait_s")
_TRAIN_NON_NEGATIVE = ("max_restarts", "restart_backoff_s")


def _walk(node: Any, prefix: str):
    if isinstance(node, DictConfig):
        for k in node:
            if OmegaConf.is_missing(node, k):
                continue
            yield from _walk(node[k], f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, ListConfig):
        for i, v in enumerate(node):
            yield from _walk(v, f"{prefix}[{i}]")
    else:
        yield prefix, node


def validate_guards(cfg: DictConfig, issues: Issues) -> None:
    """Non-finite numbers, non-positive timeouts, negative restart settings, a bad run name."""
    for path, value in _walk(cfg, ""):
        if isinstance(value, float) and not math.isfinite(value):
            issues.add(path, value, "must be a finite number", "use a finite value (inf and nan are refused)")
    if "train" in cfg:
        t = cfg.train
        for key in _TRAIN_POSITIVE:
            if key in t:
                issues.check(
                    isinstance(t[key], int | float) and t[key] > 0,
                    f"train.{key}",
                    t[key],
                    "must be > 0 (seconds)",
                    "set a positive number of seconds",
                )
        for key in _TRAIN_NON_NEGATIVE:
            if key in t:
                issues.check(
                    isinstance(t[key], int | float) and t[key] >= 0,
                    f"train.{key}",
                    t[key],
                    "must be >= 0",
                    "use 0 to disable",
                )
    if not OmegaConf.is_missing(cfg, "name"):
        name = cfg.name
        ok = (
            isinstance(name, str)
            and name not in ("", ".", "..")
            and "/" not in name
            and "\\" not in name
            and "\x00" not in name
        )
        issues.check(
            ok,
            "name",
            name,
            "must be a single path component (it names a directory under train.output_dir)",
            "use a plain name such as name=my_run, without '/', '..' or an empty string",
        )


def validate_model_type(
    model: DictConfig, raw: dict, issues: Issues, *, model_types: tuple[str, ...] = ()
) -> None:
    """``model.path``'s config.json ``model_type`` must be the configured family's: its name or one
    of ``model_types`` (the flavour the numbers declare, e.g. ``qwen3_5_moe`` of ``qwen3_5``)."""
    mt = raw.get("model_type")  # a JSON dict read from disk, not the run config
    issues.check(
        mt is None or mt == model.family or mt in model_types,
        "model.path",
        model.path,
        f"config.json has model_type={mt!r} but model.family={model.family!r}"
        + (f" reads {list(model_types)}" if model_types else ""),
        f"point model.path at a {model.family} checkpoint, or pick the model family of this one",
    )
