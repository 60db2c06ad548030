"""A deterministic worker error is not restarted, every command still reads the run dir it left,
and a rank stuck in a collective is named.

One tiny run (every degree 1, ``train.max_restarts=3``) whose LLM rank raises NotImplementedError
at its first optimizer step (the ``DHP_INJECT_FAULT`` worker hook, passed to the actors through
their runtime env) runs through ``dhp.runtime.loop.train.train`` on the shared test Ray. Checked: it
ends on the first attempt (no restart event, no new Ray), naming the error and the rank; the
run dir's ``traceback.txt`` holds the rank's traceback down to the raising line and the driver's;
``metrics.jsonl`` ends with a ``failed`` event that ``dhp runs`` shows; ``dhp report`` refuses the
run with a clear message (no step logged), never an internal error.

A second run (tiny_vlm: vision SP=2, LLM TP=2) has LLM rank 1 block, in step 2, in a collective
its peers never join (after the gradient sync's own). ``train.step_timeout_s`` fires; the error
names that rank and the part of the step it is stuck in, and ``traceback.txt`` holds every rank's
Python stack, read while they still ran, and the driver's; no rank process is left.
"""

from __future__ import annotations

import inspect
import io
import json
import re
import time

import pytest
from cli_here import dhp_here, explain
from plans import ALL_ONE
from rich.console import Console

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def failed_run(ray_local, tmp_path_factory):
    """(run dir, the RuntimeFailure, seconds the failed run took)."""
    from rich.console import Console

    from dhp.errors import RuntimeFailure
    from dhp.runtime.actors.failures import FAULT_ENV
    from dhp.runtime.loop.train import train
    from dhp.validation import load_config

    out = tmp_path_factory.mktemp("runs")
    run = ["name=nie", f"train.output_dir={out}", "train.steps=2", "train.max_restarts=3"]
    cfg = load_config("tiny_vlm", [*ALL_ONE, *run, "train.restart_backoff_s=0"])
    console = io.StringIO()
    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, "raise:llm/0:optimizer")
        with pytest.raises(RuntimeFailure) as err:
            train(cfg, console=Console(file=console, width=200))
    took = time.monotonic() - t0
    (run_dir,) = (out / "nie").iterdir()
    return run_dir, err.value, took, console.getvalue()


def test_not_implemented_in_a_worker_ends_the_run_at_once(failed_run) -> None:
    from dhp.runtime.actors import failures

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
    lines, first = inspect.getsourcelines(failures.FaultHook._fire)
    raising = next(i for i, ln in enumerate(lines) if "raise NotImplementedError" in ln) + first
    assert f'failures.py", line {raising}, in _fire' in tb, tb[-3000:]
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


@pytest.fixture(scope="module")
def hung_run(ray_local, tmp_path_factory):
    """(run dir, the RuntimeFailure, seconds, rank processes left) of a run whose LLM rank 1 hangs."""
    from interrupts import orphans_since, rank_processes

    from dhp.errors import RuntimeFailure
    from dhp.runtime.actors.failures import FAULT_ENV
    from dhp.runtime.loop.train import train
    from dhp.validation import load_config

    out = tmp_path_factory.mktemp("hang")
    run = ["name=hang", f"train.output_dir={out}", "train.steps=3", "train.max_restarts=0"]
    cfg = load_config("tiny_vlm", [*run, f"train.step_timeout_s={HANG_TIMEOUT_S}"])
    before = set(rank_processes())
    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, "hang:llm/1:grad_sync:2")
        with pytest.raises(RuntimeFailure) as err:
            train(cfg, console=Console(file=io.StringIO(), width=200))
    took = time.monotonic() - t0
    (run_dir,) = (out / "hang").iterdir()
    return run_dir, err.value, took, orphans_since(before)


HANG_TIMEOUT_S = 5


def test_a_rank_stuck_in_a_collective_is_named_with_every_rank_stack(hung_run) -> None:
    run_dir, err, took, left = hung_run
    text = str(err)
    assert f"'finalize_grads' did not finish in {float(HANG_TIMEOUT_S)}s on rank(s) [1]" in text, text
    stuck = [ln for ln in text.splitlines() if "stuck:" in ln]
    assert len(stuck) == 1, text  # the other ranks finished their calls: idle, not named
    assert "module 'llm' rank 1 (pid " in stuck[0], stuck
    assert "in finalize_grads (the gradient sync), at torch/distributed/distributed_c10d.py:" in stuck[0]
    assert stuck[0].endswith(" in barrier"), stuck
    tb = (run_dir / "traceback.txt").read_text()
    sections = tb.split("\n---- ")
    heads = [s.splitlines()[0] for s in sections[1:]]
    for who in ("'vision' rank 0", "'vision' rank 1", "'llm' rank 0", "'llm' rank 1"):
        (head,) = [h for h in heads if h.startswith(f"stack of module {who} (pid ")]
        body = next(s for s in sections if s.startswith(head))
        assert "(most recent call first)" in body and "main_loop" in body, body[:2000]
        assert ("in finalize_grads" in head) == (who == "'llm' rank 1"), head
    hung = next(s for s in sections if s.startswith("stack of module 'llm' rank 1"))
    assert re.search(
        r'failures.py", line \d+ in _fire\n.*\n.*worker_step.py", line \d+ in finalize_grads', hung
    ), hung
    assert heads[-1] == "driver" and "CallTimeout" in sections[-1]
    assert not left, left  # the hung rank is gone with its group
    assert took < HANG_TIMEOUT_S + 60, took
    print(f"hung run took {took:.1f} s (step timeout {HANG_TIMEOUT_S} s)")
