"""Output that does not go to a terminal is laid out wide: table cells and paths are never cut."""

from __future__ import annotations

import io
import subprocess
import sys

from rich.table import Table

from dhp.term import LOG_WIDTH, make_console


def test_off_a_terminal_the_width_is_fixed_and_wide(monkeypatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    buf = io.StringIO()
    console = make_console(file=buf)
    assert console.width == LOG_WIDTH
    path = "runs/" + "/".join(["a_rather_long_run_name"] * 3) + "/20260101-000000"
    table = Table()
    for col in ("run", "status", "steps", "last loss", "checkpoints", "trackers"):
        table.add_column(col, no_wrap=col == "run")
    table.add_row(path, "finished", "4/4", "1.2345", "step_000004", "tensorboard, wandb, mlflow")
    console.print(table)
    console.print(f"run dir: {path}")
    out = buf.getvalue()
    assert "…" not in out and "finished" in out
    assert f"run dir: {path}\n" in out  # one line, not folded


def test_columns_still_wins(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    assert make_console(file=io.StringIO()).width == 100


def test_cli_output_piped_is_not_cut(monkeypatch) -> None:
    env = {k: v for k, v in __import__("os").environ.items() if k != "COLUMNS"}
    out = subprocess.run(
        [sys.executable, "-m", "dhp.cli", "recipes"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "…" not in out.stdout
    assert max(len(line) for line in out.stdout.splitlines()) > 80  # laid out wider than Rich's default


def test_percent_is_the_one_format_of_a_fraction() -> None:
    from dhp.term import percent

    assert percent(0.3347) == "33.5%"
    assert percent(2.9e-4) == "0.029%"  # a CPU run's MFU keeps two significant digits
    assert percent(0.0) == "0.0%"
