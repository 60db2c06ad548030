"""A deterministic worker error is not restarted, and every command still reads the run dir it left.

One tiny run (every degree 1, ``train.max_restarts=3``) whose LLM rank raises NotImplementedError
at its first optimizer step (the ``DHP_INJECT_FAULT`` worker hook, passed to the actors through
their runtime env) runs through ``dhp.runtime.train.train`` on the shared test Ray. Checked: it
ends on the first attempt (no restart event, no new Ray), naming the error and the rank; the
run dir's ``traceback.txt`` holds the rank's traceback down to the raising line and the driver's;
``metrics.jsonl`` ends with a ``failed`` event that ``dhp runs`` shows; ``dhp report`` refuses the
run with a clear message (no step logged), never an internal error.
"""

from __future__ import annotations

import inspect
import io
import json
import time

import pytest
from cli_here import dhp_here, explain
from plans import ALL_ONE

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def failed_run(ray_local, tmp_path_factory):
    """(run dir, the RuntimeFailure, seconds the failed run took)."""
    from rich.console import Console

    from dhp.errors import RuntimeFailure
    from dhp.runtime.failures import FAULT_ENV
    from dhp.runtime.train import train
    from dhp.validation import load_config

    out = tmp_path_factory.mktemp("runs")
    run = ["name=nie", f"train.output_dir={out}", "train.steps=2", "train.max_restarts=3"]
    cfg = load_config("tiny_vlm", [*ALL_ONE, *run, "train.restart_backoff_s=0"])
    console = io.StringIO()
    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, "llm:0")
        with pytest.raises(RuntimeFailure) as err:
            train(cfg, console=Console(file=console, width=200))
    took = time.monotonic() - t0
    (run_dir,) = (out / "nie").iterdir()
    return run_dir, err.value, took, console.getvalue()


def test_not_implemented_in_a_worker_ends_the_run_at_once(failed_run) -> None:
    from dhp.runtime import failures

    run_dir, err, took, console = failed_run
    text = str(err)
    assert "module 'llm' rank 0" in text and "NotImplementedError" in text, text
    assert "not restarted: a Python exception" in text, text
    assert f"tracebacks: {run_dir / 'traceback.txt'}" in text, text
    assert "restart 1" not in console, console  # the first attempt is the only one
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in rows] == ["failed"], rows
    assert rows[0]["step"] == 1 and rows[0]["traceback"] == "traceback.txt"
    # the traceback file names the raising line of the worker, then the driver's own traceback
    tb = (run_dir / "traceback.txt").read_text()
    lines, first = inspect.getsourcelines(failures.maybe_inject_fault)
    raising = next(i for i, ln in enumerate(lines) if "raise NotImplementedError" in ln) + first
    assert f'failures.py", line {raising}, in maybe_inject_fault' in tb, tb[-3000:]
    assert "---- module 'llm' rank 0 (code)" in tb and "---- driver" in tb, tb[-3000:]
    assert tb.index("---- module 'llm'") < tb.index("---- driver")
    assert "outcome: run ended" in tb and tb.count("==== attempt") == 1, tb[:2000]
    print(f"failed run took {took:.1f} s")


def test_runs_and_report_read_the_failed_run(failed_run) -> None:
    from dhp.errors import DhpError

    run_dir, *_ = failed_run
    listed = dhp_here("runs", str(run_dir.parent.parent))
    assert listed.exit_code == 0, explain(listed)
    row = next(ln for ln in listed.output.splitlines() if run_dir.name in ln)
    assert "failed" in row and "0/2" in row, explain(listed)
    report = dhp_here("report", str(run_dir))
    assert isinstance(report.exception, DhpError), explain(report)  # `dhp` prints it, exit 2
    assert "the run failed at step 1" in str(report.exception), explain(report)
    assert str(run_dir / "traceback.txt") in str(report.exception), explain(report)
