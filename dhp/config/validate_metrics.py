"""Checks of ``metrics``: known logger names, ``jsonl`` kept, and every configured tracker installed.

A tracker's package is looked up (``importlib.util.find_spec``), not imported, so a config naming
``wandb`` or ``mlflow`` without the extra fails here, before Ray or any run directory exists.
"""

from __future__ import annotations

import importlib.util

from omegaconf import DictConfig

from dhp.config.issues import Issues

LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")
WANDB_MODES = ("online", "offline", "disabled")
#: logger -> (module to find, the extra that installs it)
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


def validate_metrics(metrics: DictConfig, issues: Issues) -> None:
    """Append an issue for each unknown, duplicated or uninstalled logger and a bad wandb mode."""
    loggers = list(metrics.loggers)
    for name in loggers:
        issues.check(
            name in LOGGERS,
            "metrics.loggers",
            name,
            f"unknown logger; known: {', '.join(LOGGERS)}",
            "write e.g. metrics.loggers=[jsonl,tensorboard,wandb,mlflow]",
        )
    issues.check(
        len(set(loggers)) == len(loggers),
        "metrics.loggers",
        loggers,
        "a logger is listed twice",
        "list each logger once",
    )
    issues.check(
        "jsonl" in loggers,
        "metrics.loggers",
        loggers,
        "jsonl is required: metrics.jsonl is the run's record (dhp report, dhp runs and sweeps read it)",
        "add jsonl, e.g. metrics.loggers=[jsonl,wandb]",
    )
    for name, (module, extra) in PACKAGES.items():
        if name in loggers:
            issues.check(
                importlib.util.find_spec(module) is not None,
                "metrics.loggers",
                name,
                f"the {module} package is not installed",
                f"pip install -e '.[{extra}]' (or pip install {module}), or remove {name} from metrics.loggers",
            )
    if metrics.wandb.mode is not None:  # null: wandb decides ($WANDB_MODE, else online)
        issues.one_of(metrics.wandb.mode, "metrics.wandb.mode", WANDB_MODES)
