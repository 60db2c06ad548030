"""``metrics.jsonl`` (one object per logged step, fixed names) and optional TensorBoard events."""

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
)


class MetricsWriter:
    """Append records to ``metrics.jsonl`` (flushed per line); scalars also to TensorBoard when on."""

    def __init__(self, path: Path, *, modules: list[str], tensorboard_dir: Path | None) -> None:
        self.path = path
        self.keys = set(METRIC_KEYS) | {f"{m}_{p}_s" for m in modules for p in ("fwd", "bwd", "step")}
        self._file = path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(tensorboard_dir))

    def write(self, record: dict[str, Any]) -> None:
        """Write one record; a missing or unknown key is a programming error (fixed names)."""
        if set(record) != self.keys:
            raise RuntimeFailure(
                f"metrics record keys differ from the fixed set: missing {sorted(self.keys - set(record))}, "
                f"unknown {sorted(set(record) - self.keys)}"
            )
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, int | float) and k != "step":
                    self._tb.add_scalar(k, v, record["step"])
            for group in ("peak_mem_bytes", "bad_samples", "data"):
                if isinstance(record[group], dict):
                    for k, v in record[group].items():
                        self._tb.add_scalar(f"{group}/{k}", v, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl``."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
