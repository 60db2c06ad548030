"""A resumed run's LR horizon: the checkpoint's, or the run's own when the user asks for it.

The horizon is what the schedule stretches its curve over: ``(total_steps, warmup_steps)``, saved in
every checkpoint's ``scheduler_state``. A resume whose run length differs from the checkpoint's (a
changed ``train.steps`` or ``train.epochs``) would move every later step's LR. ``train.resume_horizon``
decides: ``keep`` (default) keeps the checkpoint's horizon, so the LR goes on as in the run that was
interrupted (steps past it run at the floor); ``new`` takes the run's own. Either way the change is
said on the console and recorded in metrics.jsonl's ``resume`` event (``lr_horizon``). Pure; driver
side.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from dhp.runtime.loop.schedule import Schedule


@dataclass(frozen=True)
class HorizonChange:
    """The checkpoint's horizon differs from the run's; ``kept``: the checkpoint's is used."""

    step: int  # the checkpoint's step: the next step run is step + 1
    checkpoint: tuple[int, int]  # (total_steps, warmup_steps) saved
    run: tuple[int, int]  # this run's
    kept: bool
    lr_checkpoint: float  # the next step's LR under the checkpoint's horizon
    lr_run: float  # under the run's

    def line(self) -> str:
        """What the console says."""
        (ct, cw), (rt, rw) = self.checkpoint, self.run
        was, now = f"{ct} steps (warmup {cw})", f"{rt} steps (warmup {rw})"
        nxt = self.step + 1
        if self.kept:
            return (
                f"the run is {now}, the checkpoint's LR schedule {was}: the schedule keeps the "
                f"checkpoint's horizon (train.resume_horizon=keep), step {nxt} runs at lr "
                f"{self.lr_checkpoint:.4g}; train.resume_horizon=new would stretch it over {rt} steps "
                f"(step {nxt} at lr {self.lr_run:.4g})"
            )
        return (
            f"the LR schedule's horizon moves from the checkpoint's {was} to the run's {now} "
            f"(train.resume_horizon=new): step {nxt} runs at lr {self.lr_run:.4g} instead of "
            f"{self.lr_checkpoint:.4g}"
        )

    def record(self) -> dict[str, Any]:
        """The ``lr_horizon`` field of the resume event."""
        return {
            "checkpoint_total_steps": self.checkpoint[0],
            "checkpoint_warmup_steps": self.checkpoint[1],
            "run_total_steps": self.run[0],
            "run_warmup_steps": self.run[1],
            "kept": self.kept,
            "lr_next_checkpoint": self.lr_checkpoint,
            "lr_next_run": self.lr_run,
        }


def horizon_change(saved: dict[str, Any] | None, schedule: Schedule, *, mode: str) -> HorizonChange | None:
    """The change a resume from ``saved`` (a checkpoint's ``scheduler_state``) makes to ``schedule``
    (built for this run), or None when the horizons agree or the checkpoint holds none (older
    checkpoints saved only the step). ``mode``: ``train.resume_horizon``."""
    if saved is None or "total_steps" not in saved:
        return None
    ckpt = (int(saved["total_steps"]), int(saved["warmup_steps"]))
    run = schedule.horizon()
    if ckpt == run:
        return None
    step = int(saved["step"])
    other = copy.copy(schedule)
    other.set_horizon(*ckpt)
    return HorizonChange(
        step=step,
        checkpoint=ckpt,
        run=run,
        kept=mode == "keep",
        lr_checkpoint=other.lr_at(step),
        lr_run=schedule.lr_at(step),
    )


def apply(schedule: Schedule, saved: dict[str, Any], change: HorizonChange | None) -> None:
    """Load ``saved`` into ``schedule`` and, when the change keeps it, the checkpoint's horizon."""
    schedule.load_state_dict(saved)
    if change is not None and change.kept:
        schedule.set_horizon(*change.checkpoint)
