"""The eval loss of a pass, summed from the consumer's endpoint leaders, and its metrics.jsonl event.

``loss = sum(loss_sum) / sum(num_tokens)`` over every eval micro-batch and every endpoint leader
(one per data replica, or per (replica, CP rank)): the token-weighted mean cross-entropy of all eval
label tokens, plus (an MoE LLM) the router's load-balancing term as a training step puts it into
``loss_sum`` (the eval micro-batch is its batch). ``aux_losses``: each unweighted auxiliary loss,
weighted by the leaders' label tokens, as a step's. Pure; driver side.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from dhp.data.eval_batches import EVAL_SAMPLES


@dataclass(frozen=True)
class EvalResult:
    """One eval pass: the loss over ``num_label_tokens`` label tokens of ``samples`` samples."""

    loss: float
    num_label_tokens: int
    samples: int
    batches: int
    seconds: float
    aux_losses: dict[str, float] = field(default_factory=dict)

    def event(self, *, step: int, best: bool | None) -> dict[str, Any]:
        """The ``{"event": "eval", ...}`` line of metrics.jsonl after step ``step`` (``best``: the
        lowest eval loss so far, when ``train.keep_best``; None otherwise)."""
        out = {
            "event": "eval",
            "step": step,
            "time": time.time(),
            "eval_loss": self.loss,
            "eval_tokens": self.num_label_tokens,
            "eval_samples": self.samples,
            "eval_batches": self.batches,
            "eval_s": self.seconds,
            "aux_losses": dict(self.aux_losses),
        }
        if best is not None:
            out["best"] = best
        return out

    def scalars(self) -> dict[str, float]:
        """What the experiment loggers get at the step (``eval/loss`` and the rest)."""
        out = {"eval/loss": self.loss, "eval/tokens": float(self.num_label_tokens), "eval/s": self.seconds}
        out |= {f"eval/aux_losses/{k}": v for k, v in self.aux_losses.items()}
        return out


@dataclass
class EvalParts:
    """The sums of a pass in progress."""

    loss_sum: float = 0.0
    tokens: int = 0
    weighted_aux: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    batches: int = 0

    def add(self, leaders: list[dict[str, Any]]) -> None:
        """One eval micro-batch's results of every endpoint leader."""
        for s in leaders:
            self.loss_sum += s["loss_sum"]
            self.tokens += s["num_tokens"]
            for name, value in s["aux_losses"].items():
                self.weighted_aux[name] = self.weighted_aux.get(name, 0.0) + value * s["num_tokens"]

    def count_batch(self, data: Any) -> None:
        """One eval batch done (a StepData of ``dhp.data.eval_batches``): its eval samples, the
        top-up copies not counted."""
        self.batches += 1
        self.samples += int(data.metrics[EVAL_SAMPLES])

    def result(self, *, seconds: float) -> EvalResult:
        n = max(self.tokens, 1)
        return EvalResult(
            loss=self.loss_sum / n if self.tokens else float("nan"),
            num_label_tokens=self.tokens,
            samples=self.samples,
            batches=self.batches,
            seconds=seconds,
            aux_losses={k: v / n for k, v in self.weighted_aux.items()},
        )
