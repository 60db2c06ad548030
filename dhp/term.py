"""The consoles dhp prints through: full width on a terminal, a fixed wide width everywhere else.

Rich sizes a console that is not a terminal (CI logs, ``| tee``, a file) at 80 columns, and a table
wider than that shortens its cells ("finis…") while long lines fold mid-path. dhp's output is read
back from such logs, so off a terminal it is laid out at :data:`LOG_WIDTH` columns instead: tables
up to that width wrap inside their cells, and no line a run prints (run dirs, paths, the estimate)
is cut. ``$COLUMNS`` still wins when set, as it does for Rich.
"""

from __future__ import annotations

import os
import sys
from typing import IO

from rich.console import Console

#: columns of output that does not go to a terminal (wide enough for a run dir and its table row)
LOG_WIDTH = 200


def make_console(*, stderr: bool = False, file: IO[str] | None = None) -> Console:
    """A Console on stdout (or stderr, or ``file``): the terminal's width on a terminal, else
    ``$COLUMNS`` when set, else :data:`LOG_WIDTH`."""
    stream = file if file is not None else (sys.stderr if stderr else sys.stdout)
    isatty = getattr(stream, "isatty", None)
    width = None if (isatty is not None and isatty()) or os.environ.get("COLUMNS") else LOG_WIDTH
    return Console(stderr=stderr, file=file, width=width)


def percent(fraction: float) -> str:
    """A fraction as a percentage for every console table (MFU in the plan, the run summary and
    ``dhp report`` alike): one decimal from 0.1 %, two significant digits below (a CPU run's 0.029 %)."""
    pct = 100.0 * fraction
    return f"{pct:.1f}%" if abs(pct) >= 0.1 or pct == 0 else f"{pct:.2g}%"
