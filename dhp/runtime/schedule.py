"""Learning-rate schedule: linear warmup, then cosine decay to ``min_lr_ratio * lr``. Driver side."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class WarmupCosine:
    """``lr_at(s)`` for 0-based optimizer step ``s``; ``state_dict()`` = ``{"step": next step}``.

    Warmup: ``lr * (s + 1) / warmup_steps`` for ``s < warmup_steps`` (never 0). Then cosine from
    ``lr`` at ``s = warmup_steps`` to ``lr * min_lr_ratio`` at ``s = total_steps - 1``.
    """

    lr: float
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float
    step: int = 0

    def lr_at(self, s: int) -> float:
        if s < self.warmup_steps:
            return self.lr * (s + 1) / self.warmup_steps
        span = max(1, self.total_steps - 1 - self.warmup_steps)
        progress = min(1.0, (s - self.warmup_steps) / span)
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def next_lr(self) -> float:
        """The lr of the step about to run; advances the schedule."""
        lr = self.lr_at(self.step)
        self.step += 1
        return lr

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
