"""A rich progress bar for a long operation whose library function reports ``(done, total)``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

ProgressFn = Callable[[int, int], None]


@contextmanager
def progress_bar(console: Console, description: str) -> Iterator[ProgressFn]:
    """Yield ``update(done, total)``; the bar is drawn on ``console`` (plain lines when not a TTY)."""
    with Progress(
        TextColumn(f"[bold]{description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update
