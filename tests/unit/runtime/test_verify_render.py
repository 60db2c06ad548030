"""`dhp verify` prints each step once (live), then a summary: no repeated step table, no cut title."""

from __future__ import annotations

import io

from rich.console import Console

from dhp.runtime.verify.compare import StepDiff, VerifyReport, render_report, render_step


def _step(n: int, grad: float) -> StepDiff:
    return StepDiff(
        n,
        2.0 + n,
        2.0 + n,
        1.0,
        1.0,
        {"llm": grad, "vision": 1e-7},
        {"llm": "lm_head.weight", "vision": "blocks.0.attn.qkv.weight"},
        {"llm": 1e-8, "vision": 2e-8},
        {"llm": "norm.weight", "vision": "merger.mlp.0.weight"},
    )


def test_steps_once_and_the_plan_whole() -> None:
    summary = "collocated | vision sp2 tp1 dp1 ac=selective | llm tp2 sp=on dp1 ac=selective | mb 4 | gloo"
    report = VerifyReport(plan_summary=summary)
    buf = io.StringIO()
    console = Console(file=buf, width=80)  # a narrow log: nothing may be cut
    for n, grad in ((1, 3e-6), (2, 5e-4)):  # step 2 is out of tolerance on the LLM
        report.steps.append(_step(n, grad))
        render_step(report.steps[-1], report, console=console)
    render_report(report, console=console)
    out = buf.getvalue()
    assert out.count("step   1") == 1 and out.count("step   2") == 1  # each step printed once
    assert summary in out  # the plan on one line, whole
    rows = [ln.split() for ln in out.splitlines()]
    assert ["llm", "5.0e-04", "2"] in [r[:3] for r in rows]  # the LLM's worst gradient diff and its step
    assert "failing steps: 2" in out and "FAIL" in out
