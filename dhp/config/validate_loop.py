"""Checks of the ``train.*`` and ``metrics.*`` keys no other check reads, so ``dhp plan`` reports
them before anything starts: the seed, the run's output folder, ``train.resume``, and the trackers'
project / experiment names. (Batch sizes, schedule and checkpoints: ``validate_run.py``; timeouts
and restarts: ``validate_guards.py``; logger names: ``validate_metrics.py``.)
"""

from __future__ import annotations

from omegaconf import DictConfig

from dhp.config.constants import ROUTER_AUX_LOSS_MODES
from dhp.config.issues import Issues


def validate_loop(cfg: DictConfig, issues: Issues) -> None:
    """``train.seed`` >= 0, a non-empty ``train.output_dir`` and ``train.resume``, a known
    ``train.router_aux_loss``, named trackers."""
    train, metrics = cfg.train, cfg.metrics
    issues.check(
        train.router_aux_loss in ROUTER_AUX_LOSS_MODES,
        "train.router_aux_loss",
        train.router_aux_loss,
        f"unknown value; allowed: {', '.join(ROUTER_AUX_LOSS_MODES)} (step: over the step's batch, as "
        "transformers on the whole batch; micro_batch: over each micro-batch, cheaper, not HF's loss)",
        "use train.router_aux_loss=step (the default) or train.router_aux_loss=micro_batch",
    )
    issues.check(train.seed >= 0, "train.seed", train.seed, "must be >= 0", "e.g. train.seed=0")
    issues.check(
        bool(str(train.output_dir).strip()),
        "train.output_dir",
        train.output_dir,
        "must name a folder (runs are written under it)",
        "e.g. train.output_dir=runs",
    )
    issues.check(
        train.resume is None or bool(str(train.resume).strip()),
        "train.resume",
        train.resume,
        "must be null, auto, or a checkpoint path",
        "use train.resume=auto to continue the newest checkpoint of this run name",
    )
    issues.check(
        bool(str(metrics.wandb.project).strip()),
        "metrics.wandb.project",
        metrics.wandb.project,
        "must name a project",
        "e.g. metrics.wandb.project=dhp",
    )
    issues.check(
        bool(str(metrics.mlflow.experiment).strip()),
        "metrics.mlflow.experiment",
        metrics.mlflow.experiment,
        "must name an experiment",
        "e.g. metrics.mlflow.experiment=dhp",
    )
