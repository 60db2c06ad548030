"""``dhp runs`` and ``dhp report`` read a run directory in every state dhp can leave it.

Each state is built from the files of one real run (``recorded_run/``: the ``config.yaml`` and
``metrics.jsonl`` that ``dhp train conf=tiny_vlm train.steps=3`` wrote, every degree 1), cut or
extended the way a run writes them: events are the lines ``dhp.runtime.loop.train`` appends (restart,
resume, failed), a cut line is what a kill mid-write leaves. Both commands run through the CLI's
own app. A command may refuse a run dir with a user error (a DhpError: no step to plot), never with
anything else: that would be the "internal error ... This is a bug in dhp" exit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dhp.cli import app
from dhp.errors import DhpError

pytestmark = pytest.mark.unit

RECORDED = Path(__file__).parent / "recorded_run"
OLD_KEYS = ("bad_samples", "data")  # keys an older dhp did not write


def _records() -> list[dict]:
    return [json.loads(x) for x in (RECORDED / "metrics.jsonl").read_text().splitlines()]


def _restart(n: int, step: int) -> dict:
    reason = f"module 'llm' rank 0 (pid 1{n}) died: The actor died unexpectedly"
    return {
        "event": "restart",
        "step": step,
        "restart": n,
        "time": 1.0,
        "reason": reason,
        "resume_from": None,
    }


def _lines(*objs: dict) -> str:
    return "".join(json.dumps(o) + "\n" for o in objs)


def _state(run: Path, state: str) -> None:
    """Write the files of ``state`` into the run dir ``run`` (already created)."""
    r1, r2, r3 = _records()
    if state == "empty":
        return
    (run / "config.yaml").write_text((RECORDED / "config.yaml").read_text())
    metrics = run / "metrics.jsonl"
    if state == "config_only":
        return
    if state == "failed_before_step_1":
        failed = {"event": "failed", "step": 1, "time": 1.0, "reason": "module 'llm' rank 0 failed: X"}
        metrics.write_text(_lines(failed | {"why_not_restarted": "code", "traceback": "traceback.txt"}))
        (run / "traceback.txt").write_text("==== attempt 1\n")
    elif state == "restarted_before_step_1":
        metrics.write_text(_lines(_restart(1, 0), _restart(2, 0), _restart(3, 0)))
    elif state == "restarted":
        metrics.write_text(_lines(r1, r2, r3, _restart(1, 2), r3))
    elif state == "resumed":
        resume = {"event": "resume", "step": 2, "time": 1.0, "resume_from": "checkpoints/step_000002"}
        metrics.write_text(_lines(r1, r2, resume, r3))
    elif state == "truncated_last_line":
        metrics.write_text(_lines(r1, r2) + json.dumps(r3)[:57])
    elif state == "older_dhp":
        metrics.write_text(_lines(*({k: v for k, v in r.items() if k not in OLD_KEYS} for r in (r1, r2, r3))))
    elif state == "finished":
        metrics.write_text(_lines(r1, r2, r3))
        (run / "checkpoints" / "step_000003").mkdir(parents=True)
        (run / "checkpoints" / "step_000003" / "meta.json").write_text("{}")
    else:
        raise AssertionError(state)
    old = 1_000_000_000  # long ago: not "active"
    os.utime(metrics, (old, old))


#: state -> (status in `dhp runs`, whether `dhp report` has a curve to draw, words it must print)
STATES = {
    "empty": ("empty", False, "metrics.jsonl: missing)"),
    "config_only": ("empty", False, "metrics.jsonl: missing)"),
    "failed_before_step_1": ("failed", False, "the run failed at step 1"),
    "restarted_before_step_1": ("stopped", False, "3 event(s) only (restart, restart, restart)"),
    "restarted": ("stopped", True, "restart #1 at step 2"),
    "resumed": ("stopped", True, "resumed at step 2"),
    "truncated_last_line": ("stopped", True, "1 (a write cut short by a kill)"),
    "older_dhp": ("stopped", True, "restarts / resumes none"),
    "finished": ("finished", True, "restarts / resumes none"),
}


def _invoke(*args: str):
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    err = result.exception
    assert err is None or isinstance(err, SystemExit | DhpError), (args, repr(err), result.output[-2000:])
    return result


@pytest.mark.parametrize("state", sorted(STATES))
def test_runs_and_report_read_every_run_dir_state(state: str, tmp_path: Path) -> None:
    status, has_curve, says = STATES[state]
    run = tmp_path / "runs" / "rec" / "20261205-205004"
    run.mkdir(parents=True)
    _state(run, state)

    listed = _invoke("runs", str(tmp_path / "runs"))
    assert listed.exit_code == 0, listed.output
    row = next(ln for ln in listed.output.splitlines() if "rec/20261205-205004" in ln)
    target = "?" if state == "empty" else "3"
    assert status in row and f"/{target}" in row, listed.output

    report = _invoke("report", str(run), "--out", str(tmp_path / "png"))
    text = report.output + (str(report.exception) if report.exception else "")
    text = " ".join(text.translate({ord(c): " " for c in "│┃"}).split())  # table cells as words
    if has_curve:
        assert report.exit_code == 0, text
        assert (tmp_path / "png" / "loss.png").is_file()
    else:
        assert isinstance(report.exception, DhpError), text  # a clear refusal: exit 2 from `dhp`
    assert says in text, text


def test_an_epochs_run_is_finished_at_its_counted_length_and_its_evals_are_noted(tmp_path: Path) -> None:
    """A run by train.epochs has train.steps=0 in config.yaml: its length is the start event's
    total_steps; its eval events are noted (last and best) and drawn beside the loss."""
    from dhp.metrics.report import eval_points
    from dhp.metrics.runs import read_run

    run = tmp_path / "x" / "20000101-000000"
    run.mkdir(parents=True)
    cfg = (RECORDED / "config.yaml").read_text().replace("  steps: 3\n", "  steps: 0\n  epochs: 1.0\n", 1)
    (run / "config.yaml").write_text(cfg)
    r1, r2, r3 = _records()
    start = {"event": "start", "step": 0, "time": 1.0, "total_steps": 3, "epochs": 1.0}
    evals = [
        {"event": "eval", "step": s, "time": 1.0, "eval_loss": v, "eval_samples": 4}
        for s, v in ((2, 6.5), (3, 6.6))
    ]
    (run / "metrics.jsonl").write_text(_lines(start, r1, r2, evals[0], r3, evals[1]))
    (run / "checkpoints" / "step_000003").mkdir(parents=True)
    (run / "checkpoints" / "step_000003" / "meta.json").write_text("{}")
    info = read_run(run)
    assert (info.status, info.target_steps) == ("finished", 3)
    assert "eval 6.6000 at step 3 (best 6.5000 at step 2)" in info.note
    assert eval_points([r1, r2, r3], evals) == ([1, 2], [6.5, 6.6])
