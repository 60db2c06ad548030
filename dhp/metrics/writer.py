"""``metrics.jsonl`` (one object per logged step, fixed names), fanned out to the experiment loggers
(TensorBoard, wandb, MLflow: ``dhp.metrics.loggers``) with the same values at the same step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dhp.errors import RuntimeFailure

#: Every record has exactly these keys (plus ``<module>_{fwd,bwd,step}_s`` per module).
METRIC_KEYS = (
    "step",
    "loss",
    "lr",
    "lr_groups",  # {"<module>/<param group>": LR this step}; "default" = parameters no glob matches
    "grad_norm",
    "tokens_per_s_vision",
    "tokens_per_s_text",
    "step_s",
    "wait_s",
    "handoff_s",
    "peak_mem_bytes",
    "mfu",
    "bad_samples",  # cumulative skipped samples by reason (data.on_bad_sample=skip); {} when none
    "data",  # the loader: wait_s (blocked on data), samples_per_s (build rate), workers
    # {"<module>": {tokens_per_expert_max, tokens_per_expert_mean, max_over_mean, worst_layer, layers}}
    # over the module's MoE layers this step (the worst layer); {} when no module has MoE layers
    "expert_load",
    "kernels",  # {"<module>/<kind>": kernel name}, e.g. llm/linear_attention (dhp.ops.linear_attn); {} when none
    # the loss module's auxiliary losses, unweighted ({"router_aux_loss": L} for an MoE LLM; {} otherwise)
    "aux_losses",
)


class MetricsWriter:
    """Append records to ``metrics.jsonl`` (flushed per line); the same scalars to each logger.

    ``tensorboard_dir`` is kept for callers that only want TensorBoard; ``loggers`` are already
    opened experiment loggers (``dhp.metrics.loggers.open_loggers``), closed by :meth:`close`.
    """

    def __init__(
        self,
        path: Path,
        *,
        modules: list[str],
        tensorboard_dir: Path | None = None,
        loggers: list[Any] | None = None,
    ) -> None:
        from dhp.metrics.loggers import TensorBoardLogger

        self.path = path
        self.keys = set(METRIC_KEYS) | {f"{m}_{p}_s" for m in modules for p in ("fwd", "bwd", "step")}
        self._file = path.open("a", encoding="utf-8")
        if path.stat().st_size and _ends_mid_line(path):  # a resumed run after a kill mid-record
            self._file.write("\n")
        self.loggers = list(loggers or [])
        if tensorboard_dir is not None:
            self.loggers.append(TensorBoardLogger(tensorboard_dir))

    def write(self, record: dict[str, Any]) -> None:
        """Write one record; a missing or unknown key is a programming error (fixed names)."""
        from dhp.metrics.loggers import flat_scalars

        if set(record) != self.keys:
            raise RuntimeFailure(
                f"metrics record keys differ from the fixed set: missing {sorted(self.keys - set(record))}, "
                f"unknown {sorted(set(record) - self.keys)}"
            )
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        scalars = flat_scalars(record)
        for lg in self.loggers:
            lg.log(record["step"], scalars)

    def write_event(self, event: dict[str, Any], scalars: dict[str, float]) -> None:
        """Append one event line (``{"event": "eval", "step": N, ...}``) and give the loggers its
        ``scalars`` at step N (e.g. ``eval/loss``)."""
        self._file.write(json.dumps(event, sort_keys=True) + "\n")
        self._file.flush()
        for lg in self.loggers:
            lg.log(event["step"], scalars)

    def close(self) -> None:
        self._file.close()
        for lg in self.loggers:
            lg.close()
        self.loggers = []


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl``."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def append_event(path: Path, event: dict[str, Any]) -> None:
    """Append one event line (``{"event": "start" | "restart" | "resume" | "failed", "step": ...}``) to a
    ``metrics.jsonl``, on a line of its own even after a line a kill cut short."""
    with path.open("a", encoding="utf-8") as f:
        if _ends_mid_line(path):
            f.write("\n")
        f.write(json.dumps(event) + "\n")


def _ends_mid_line(path: Path) -> bool:
    """Whether the file's last byte is not a newline (a record cut short by a kill)."""
    size = path.stat().st_size
    if size == 0:
        return False
    with path.open("rb") as f:
        f.seek(size - 1)
        return f.read(1) != b"\n"
