"""Learning-rate schedules: a linear warmup, then ``cosine``, ``linear``, ``constant`` or ``wsd``
(warmup-stable-decay) over the run's steps. Driver side; nothing here touches a device.

Every schedule: ``lr_at(s)`` for 0-based optimizer step ``s``, ``next_lr()`` (the step about to run,
then advance), ``state_dict()`` (the next step and the horizon: kind, total and warmup steps) and
``load_state_dict``. Warmup: ``lr * (s + 1) / warmup_steps`` for ``s < warmup_steps`` (never 0). The
floor is ``lr * min_lr_ratio``, reached at ``s = total_steps - 1`` and kept after it (a run resumed
past its horizon with ``train.resume_horizon=keep`` trains on at the floor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class _Warmup:
    """The warmup and the state every schedule shares; subclasses give the curve after warmup."""

    lr: float
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float
    step: int = 0
    kind: ClassVar[str] = ""

    @property
    def floor(self) -> float:
        return self.lr * self.min_lr_ratio

    def lr_at(self, s: int) -> float:
        if s < self.warmup_steps:
            return self.lr * (s + 1) / self.warmup_steps
        return self._after_warmup(s)

    def _after_warmup(self, s: int) -> float:
        raise NotImplementedError

    def _progress(self, s: int, start: int) -> float:
        """0 at step ``start``, 1 at the last step (``total_steps - 1``) and after."""
        span = max(1, self.total_steps - 1 - start)
        return min(1.0, max(0.0, (s - start) / span))

    def next_lr(self) -> float:
        """The lr of the step about to run; advances the schedule."""
        lr = self.lr_at(self.step)
        self.step += 1
        return lr

    def state_dict(self) -> dict[str, Any]:
        """The next step and the horizon (a resume compares it with the run's own)."""
        return {
            "step": self.step,
            "kind": self.kind,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next step only: the horizon is the resume's choice (``dhp.runtime.loop.horizon``)."""
        self.step = int(state["step"])

    def horizon(self) -> tuple[int, int]:
        """``(total_steps, warmup_steps)``: what the curve is stretched over."""
        return self.total_steps, self.warmup_steps

    def set_horizon(self, total_steps: int, warmup_steps: int) -> None:
        self.total_steps, self.warmup_steps = int(total_steps), int(warmup_steps)


@dataclass
class WarmupCosine(_Warmup):
    """Cosine from ``lr`` at ``s = warmup_steps`` to the floor at ``s = total_steps - 1``."""

    kind: ClassVar[str] = "cosine"

    def _after_warmup(self, s: int) -> float:
        p = self._progress(s, self.warmup_steps)
        return self.floor + (self.lr - self.floor) * 0.5 * (1.0 + math.cos(math.pi * p))


@dataclass
class WarmupLinear(_Warmup):
    """A straight line from ``lr`` at ``s = warmup_steps`` to the floor at ``s = total_steps - 1``."""

    kind: ClassVar[str] = "linear"

    def _after_warmup(self, s: int) -> float:
        return self.lr - (self.lr - self.floor) * self._progress(s, self.warmup_steps)


@dataclass
class WarmupConstant(_Warmup):
    """``lr`` from the end of the warmup on (no decay; ``min_lr_ratio`` is not used)."""

    kind: ClassVar[str] = "constant"

    def _after_warmup(self, s: int) -> float:
        return self.lr


@dataclass
class WarmupStableDecay(_Warmup):
    """Warmup, ``lr`` held (stable), then a straight line to the floor over the last
    ``round(decay_ratio * total_steps)`` steps (at least 1)."""

    decay_ratio: float = 0.1
    kind: ClassVar[str] = "wsd"

    @property
    def decay_start(self) -> int:
        decay = max(1, round(self.decay_ratio * self.total_steps))
        return max(self.warmup_steps, self.total_steps - decay)

    def _after_warmup(self, s: int) -> float:
        if s < self.decay_start:
            return self.lr
        return self.lr - (self.lr - self.floor) * self._progress(s, self.decay_start)


SCHEDULES: dict[str, type[_Warmup]] = {
    cls.kind: cls for cls in (WarmupCosine, WarmupLinear, WarmupConstant, WarmupStableDecay)
}
Schedule = _Warmup  # what the training loop holds


def make_schedule(train: Any, *, total_steps: int, warmup_steps: int) -> Schedule:
    """The schedule ``train.lr_schedule`` names (TrainConfig: ``lr``, ``min_lr_ratio``,
    ``decay_ratio``) over ``total_steps`` with ``warmup_steps`` (resolved by
    :func:`dhp.runtime.loop.run_length.run_length`)."""
    cls = SCHEDULES[train.lr_schedule]
    kw = {"decay_ratio": float(train.decay_ratio)} if cls is WarmupStableDecay else {}
    return cls(
        lr=train.lr,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        min_lr_ratio=train.min_lr_ratio,
        **kw,
    )
