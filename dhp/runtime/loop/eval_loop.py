"""The training loop's evaluations: when one is due, what it writes, and the best checkpoint.

An evaluation (``Trainer.evaluate`` over ``data.eval``'s batches) runs after step ``s`` when
``train.eval_every`` divides ``s``, and after the run's last step; never after a step a signal
asked to stop at (the stop's checkpoint comes first), and a signal during one drops it between two
eval batches. Each writes ``{"event": "eval", "step": s, "eval_loss": ...}`` to metrics.jsonl, the
same numbers to the experiment loggers (``eval/loss`` at step ``s``) and one console line.

``train.keep_best``: an eval loss below every earlier one of the run directory (``checkpoints/
best.json``, read again by a resumed or restarted attempt) makes this step's checkpoint the best
(a checkpoint is written for it when none is due), marked by ``dhp.checkpoint.best``. The driver's
RNG is put back after each pass, so an evaluation changes nothing a checkpoint or a step reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from dhp.checkpoint import capture_rng_state, restore_rng_state
from dhp.checkpoint.best import mark_best, read_best
from dhp.runtime.loop.evaluation import EvalResult


class EvalLoop:
    """The evaluations of one attempt's step loop (see the module docstring)."""

    def __init__(self, *, batches: Any, train: Any, total: int, run_dir: Path, console: Console) -> None:
        self.batches, self.train, self.total = batches, train, total
        self.checkpoints = run_dir / "checkpoints"
        self.console = console
        best = read_best(self.checkpoints) if train.keep_best else None
        self.best_loss: float | None = None if best is None else float(best["eval_loss"])
        self.losses: dict[int, float] = {}

    def due(self, step: int, *, stopping: bool) -> bool:
        """Whether an evaluation runs after ``step`` (``stopping``: a signal asked for a stop)."""
        if self.batches is None or stopping:
            return False
        every = self.train.eval_every
        return step == self.total or bool(every and step % every == 0)

    def run(self, trainer: Any, step: int, *, writer: Any, stop: Any) -> EvalResult | None:
        """Evaluate after ``step``; write the event and the loggers' scalars; None when a signal
        dropped the pass."""
        rng = capture_rng_state()
        try:
            res = trainer.evaluate(self.batches, stop=stop)
        finally:
            restore_rng_state(rng)
        if res is None:
            self.console.print(f"eval after step {step}: dropped (a stop was asked for)")
            return None
        best = self.is_best(res) if self.train.keep_best else None
        writer.write_event(res.event(step=step, best=best), res.scalars())
        self.losses[step] = res.loss
        skipped = self.batches.skipped()
        note = f", {sum(skipped.values())} bad sample(s) skipped {skipped}" if skipped else ""
        self.console.print(
            f"eval after step {step}: loss {res.loss:.4f} over {res.samples} samples "
            f"({res.num_label_tokens} label tokens, {res.seconds:.1f} s){note}" + (" [best]" if best else "")
        )
        return res

    def is_best(self, res: EvalResult) -> bool:
        return self.best_loss is None or res.loss < self.best_loss

    def keep(self, checkpoint: Path, res: EvalResult) -> None:
        """``checkpoint`` (this step's, committed) is the best so far: mark it."""
        mark_best(checkpoint, eval_loss=res.loss)
        self.best_loss = res.loss
        self.console.print(
            f"best eval loss so far ({res.loss:.4f}): {self.checkpoints / 'best'} -> {checkpoint.name}"
        )
