"""Console output of ``dhp train``: a rich progress bar with live loss and tokens/s, and a summary."""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dhp.term import percent


class TrainProgress:
    """Context manager around rich's Progress; ``update`` after each step, ``summary`` at the end."""

    def __init__(self, *, console: Console, total: int, start: int) -> None:
        self.console = console
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "loss {task.fields[loss]}  vis {task.fields[vis]} tok/s  txt {task.fields[txt]} tok/s"
            ),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self._task = self._progress.add_task(
            "train", total=total, completed=start, loss="-", vis="-", txt="-"
        )

    def __enter__(self) -> TrainProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def update(self, *, step: int, record: dict[str, Any]) -> None:
        self._progress.update(
            self._task,
            completed=step,
            loss=f"{record['loss']:.4f}",
            vis=f"{record['tokens_per_s_vision']:.0f}",
            txt=f"{record['tokens_per_s_text']:.0f}",
        )

    def summary(self, result: Any, records: list[dict[str, Any]]) -> None:
        """A table: first/last loss, median step time and its split, throughput, MFU, peak memory."""
        if not records:
            self.console.print("no steps were run")
            return
        med = lambda k: statistics.median(r[k] for r in records)  # noqa: E731
        table = Table(title=f"dhp train summary ({result.run_dir})")
        table.add_column("metric")
        table.add_column("value", justify="right")
        table.add_row("steps", f"{records[0]['step']}..{records[-1]['step']}")
        table.add_row("loss first -> last", f"{records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}")
        table.add_row("step time (median)", f"{med('step_s'):.3f} s")
        table.add_row("LLM wait on hand-off (median)", f"{med('wait_s'):.3f} s")
        table.add_row(
            "vision / text tokens/s (median)",
            f"{med('tokens_per_s_vision'):.0f} / {med('tokens_per_s_text'):.0f}",
        )
        table.add_row("MFU (median)", percent(med("mfu")))
        peak = max(v for r in records for v in r["peak_mem_bytes"].values())
        table.add_row("peak memory (max rank)", f"{peak / 2**20:.0f} MiB")
        bad = records[-1]["bad_samples"]
        if bad:
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(bad.items()))
            table.add_row("bad samples skipped", f"{sum(bad.values())} ({reasons})")
        if result.evals:
            steps = sorted(result.evals)
            best = min(steps, key=lambda k: result.evals[k])
            table.add_row(
                "eval loss first -> last (best)",
                f"{result.evals[steps[0]]:.4f} -> {result.evals[steps[-1]]:.4f} "
                f"({result.evals[best]:.4f} at step {best})",
            )
        table.add_row("last checkpoint", str(result.last_checkpoint))
        self.console.print(table)
