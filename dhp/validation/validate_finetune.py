"""Checks of a fine-tune's run length, LR schedule, evaluation and text rendering.

- the run's length: ``train.steps`` or ``train.epochs``, exactly one of them (the other 0): neither
  wins silently over the other;
- the warmup: ``train.warmup_steps`` or ``train.warmup_ratio``, not both; within the run;
- ``train.lr_schedule``, ``train.decay_ratio`` (wsd), ``train.resume_horizon``;
- evaluation: ``data.eval`` is a file or a split, not both; ``train.eval_every`` and
  ``train.keep_best`` need it; an eval batch is whole data replicas of whole micro-batches;
- ``data.chat_template`` (a known name or a ``.jinja`` file) and ``data.train_on``.

Files are not opened here (an exported run's config is validated again where its data may be
gone); the data layer reports a missing file when the run opens it, before any run directory.
"""

from __future__ import annotations

from omegaconf import DictConfig

from dhp.config.constants import LR_SCHEDULES, RESUME_HORIZONS, TRAIN_ON
from dhp.config.issues import Issues
from dhp.layout import module_layout
from dhp.models.chat_templates import is_template_file, template_names
from dhp.models.graph import known_consumer


def validate_finetune(cfg: DictConfig, issues: Issues) -> None:
    """Every rule of the module docstring, into ``issues``."""
    _run_length(cfg.train, issues)
    _schedule(cfg.train, issues)
    _evaluation(cfg, issues)
    _text(cfg.data, issues)


def _run_length(train: DictConfig, issues: Issues) -> None:
    issues.check(train.steps >= 0, "train.steps", train.steps, "must be >= 0", "e.g. train.steps=1000")
    issues.check(train.epochs >= 0, "train.epochs", train.epochs, "must be >= 0", "e.g. train.epochs=3")
    if train.steps > 0 and train.epochs > 0:
        issues.add(
            "train.epochs",
            train.epochs,
            f"train.steps={train.steps} is set too: a run's length is one of them",
            f"train.steps=0 to train {train.epochs:g} epochs, or train.epochs=0 for {train.steps} steps",
        )
    elif train.steps <= 0 and train.epochs <= 0:
        issues.add(
            "train.steps",
            train.steps,
            "the run has no length: train.steps and train.epochs are both 0",
            "set train.steps=N or train.epochs=E",
        )


def _schedule(train: DictConfig, issues: Issues) -> None:
    issues.one_of(train.lr_schedule, "train.lr_schedule", LR_SCHEDULES)
    issues.one_of(train.resume_horizon, "train.resume_horizon", RESUME_HORIZONS)
    issues.check(
        0.0 <= train.warmup_ratio < 1.0,
        "train.warmup_ratio",
        train.warmup_ratio,
        "must be in [0, 1): the share of the run's steps that warm up",
        "e.g. train.warmup_ratio=0.03",
    )
    issues.check(train.warmup_steps >= 0, "train.warmup_steps", train.warmup_steps, "must be >= 0", "use 0")
    if train.warmup_ratio > 0 and train.warmup_steps > 0:
        issues.add(
            "train.warmup_ratio",
            train.warmup_ratio,
            f"train.warmup_steps={train.warmup_steps} is set too: the warmup is one of them",
            "train.warmup_steps=0 to warm up over a share of the run, or train.warmup_ratio=0",
        )
    if train.steps > 0:  # an epochs run's length is known once its data is open (dhp.runtime.loop.run_length)
        issues.check(
            train.warmup_steps <= train.steps,
            "train.warmup_steps",
            train.warmup_steps,
            f"must be in [0, train.steps={train.steps}]",
            "shorten the warmup or train longer",
        )
    if train.lr_schedule == "wsd":
        issues.check(
            0.0 < train.decay_ratio <= 1.0,
            "train.decay_ratio",
            train.decay_ratio,
            "must be in (0, 1]: the share of the run's steps in the wsd schedule's final decay",
            "e.g. train.decay_ratio=0.1",
        )


def _evaluation(cfg: DictConfig, issues: Issues) -> None:
    train, data = cfg.train, cfg.data
    ev = data.eval
    issues.check(
        0.0 <= ev.split < 1.0,
        "data.eval.split",
        ev.split,
        "must be in [0, 1): the share of each training dataset held out for evaluation",
        "e.g. data.eval.split=0.05",
    )
    for key in ("batch_size", "max_samples"):
        issues.check(ev[key] >= 0, f"data.eval.{key}", ev[key], "must be >= 0", "use 0 for the default")
    issues.check(train.eval_every >= 0, "train.eval_every", train.eval_every, "must be >= 0", "use 0")
    on = bool(ev.path) or ev.split > 0
    if ev.path and ev.split > 0:
        issues.add(
            "data.eval.split",
            ev.split,
            f"data.eval.path={ev.path} is set too: the eval samples come from one of them",
            "data.eval.split=0 to evaluate on the file, or data.eval.path='' to hold out a share",
        )
    if ev.path and data.kind == "synthetic":
        issues.add(
            "data.eval.path",
            ev.path,
            "synthetic training data has no tokenizer to read an eval file with",
            "train on the real data (data.path=FILE), or hold out synthetic samples: data.eval.split=0.1",
        )
    for key, value in (("eval_every", train.eval_every), ("keep_best", train.keep_best)):
        if value and not on:
            issues.add(
                f"train.{key}",
                value,
                "needs evaluation data: data.eval is neither a file nor a split",
                "set data.eval.path=FILE or data.eval.split=0.05",
            )
    consumer = known_consumer(cfg.model.family)
    if on and ev.batch_size > 0 and consumer in cfg.modules:
        unit = module_layout(cfg.modules[consumer]).num_replicas * train.micro_batch_size
        issues.check(
            unit > 0 and ev.batch_size % unit == 0,
            "data.eval.batch_size",
            ev.batch_size,
            f"must be a multiple of micro_batch_size*{consumer} replicas = {unit} (each eval batch runs as a step's)",
            f"use a multiple of {unit}, or 0 (train.global_batch_size)",
        )


def _text(data: DictConfig, issues: Issues) -> None:
    issues.one_of(data.train_on, "data.train_on", TRAIN_ON)
    name = str(data.chat_template)
    issues.check(
        name in template_names() or is_template_file(name),
        "data.chat_template",
        name,
        f"unknown template; known: {', '.join(template_names())}, or a path ending in .jinja",
        "e.g. data.chat_template=chatml, or data.chat_template=checkpoint for model.path's own",
    )
