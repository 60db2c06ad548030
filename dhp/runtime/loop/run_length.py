"""The run's length in optimizer steps, and its warmup, once the training data is open.

``train.steps`` is the length itself; ``train.epochs`` (with ``train.steps=0``) makes
``ceil(epochs * samples per epoch / train.global_batch_size)`` steps, where an epoch is every
training sample once, each dataset counted ``weight`` times (the loader's ``epoch_len``: eval
records held out by ``data.eval.split`` are not in it). The loader's stream runs on across epoch
boundaries, so the last step of an epoch may take the first samples of the next. Warmup:
``train.warmup_steps``, or ``round(train.warmup_ratio * steps)``. Pure; driver side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dhp.errors import ConfigError, ConfigIssue


@dataclass(frozen=True)
class RunLength:
    """How long the run is and why (``epochs`` 0: set by ``train.steps``)."""

    steps: int
    warmup_steps: int
    epochs: float
    samples_per_epoch: int
    global_batch_size: int

    @property
    def steps_per_epoch(self) -> float:
        return self.samples_per_epoch / self.global_batch_size

    def epoch_at(self, step: int) -> float:
        """Epochs of samples the first ``step`` steps consumed (bad samples skipped not counted)."""
        return step * self.global_batch_size / self.samples_per_epoch

    def describe(self) -> str:
        """One console line: where the step count comes from."""
        if self.epochs:
            how = (
                f"train.epochs={self.epochs:g}: {self.epochs:g} x {self.samples_per_epoch} samples / "
                f"{self.global_batch_size} per step = {self.steps} steps"
            )
        else:
            how = (
                f"train.steps={self.steps} ({self.epoch_at(self.steps):.2f} epochs of "
                f"{self.samples_per_epoch} samples)"
            )
        return f"{how}; warmup {self.warmup_steps} steps"

    def record(self) -> dict[str, Any]:
        """The fields metrics.jsonl's ``start`` and ``resume`` events carry."""
        return {
            "total_steps": self.steps,
            "warmup_steps": self.warmup_steps,
            "epochs": self.epochs,
            "samples_per_epoch": self.samples_per_epoch,
        }


def run_length(train: Any, *, samples_per_epoch: int) -> RunLength:
    """The RunLength of ``train`` (TrainConfig) over data of ``samples_per_epoch`` samples.

    ConfigError when the warmup is longer than the run (known only now for an epochs run)."""
    gbs = int(train.global_batch_size)
    epochs = float(train.epochs)
    steps = int(train.steps) if train.steps > 0 else math.ceil(epochs * samples_per_epoch / gbs)
    warmup = int(train.warmup_steps) if train.warmup_ratio == 0 else round(train.warmup_ratio * steps)
    if warmup > steps:
        raise ConfigError(
            [
                ConfigIssue(
                    "train.warmup_steps",
                    train.warmup_steps,
                    f"longer than the run: {steps} steps ({epochs:g} epochs of {samples_per_epoch} "
                    f"samples at {gbs} per step)",
                    "shorten the warmup, use train.warmup_ratio, or train longer",
                )
            ]
        )
    return RunLength(
        steps=steps,
        warmup_steps=warmup,
        epochs=epochs if train.steps == 0 else 0.0,
        samples_per_epoch=samples_per_epoch,
        global_batch_size=gbs,
    )
