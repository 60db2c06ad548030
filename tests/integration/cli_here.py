"""Run a ``dhp`` command in this process, on the shared test Ray (``ray_local``).

The command is the CLI's own (typer's test runner calls the app: argument parsing, the printed
tables, the exit code); only the process is the test's. A run started this way joins the Ray the
test process already has, so a command costs neither a Ray start nor the CLI's imports in a new
interpreter (~10 CPU-s on a small machine). Tests of the entry point itself (signals, exit codes of a
real process) keep running ``python -m dhp.cli`` in a subprocess.
"""

from __future__ import annotations

from click.testing import Result
from typer.testing import CliRunner

from dhp.cli import app


def dhp_here(*args: str) -> Result:
    """``dhp ARGS...`` in this process; ``.exit_code``, ``.output`` (stdout and stderr) and ``.exception``."""
    return CliRunner().invoke(app, list(args))


def words(result: Result) -> str:
    """The output with every run of whitespace made one space (the console wraps at 80 columns)."""
    return " ".join(result.output.split())


def explain(result: Result) -> str:
    """The tail of a result's output and its exception, for an assertion message."""
    return (result.output + "\n" + repr(result.exception))[-4000:]
