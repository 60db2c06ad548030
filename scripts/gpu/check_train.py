"""``dhp plan`` of a 1-GPU recipe; ``dhp train`` where Ray is importable, with the planner's predicted
step time (``estimate.step_time_s`` of ``dhp plan --json``, default profile) beside the measured one
(median ``step_s`` of the steps after the first in metrics.jsonl)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from check_helpers import Ctx, tail

# ---------------------------------------------------------------------------------------------
# 7. dhp train on one GPU (needs Ray, whose wheel is too big to ship in .whl/)

TRAIN_OVERRIDES = [
    "conf=tiny_vlm",
    "cluster=h200_1x",
    "model.dtype=bfloat16",
    "modules.vision.gpus=1",
    "modules.vision.parallel.sp=1",
    "modules.llm.gpus=1",
    "modules.llm.parallel.tp=1",
    "train.steps=6",
    "train.checkpoint_every=0",
]


def check_train(ctx: Ctx, args) -> str:
    dhp = [sys.executable, "-m", "dhp.cli"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    plan = subprocess.run(
        [*dhp, "plan", *TRAIN_OVERRIDES, "--dry-run"], capture_output=True, text=True, env=env, timeout=120
    )
    ctx.fig("plan_rc", plan.returncode)
    ctx.fig("plan_output", tail(plan.stdout + plan.stderr, 1200))
    predicted = _predicted_step_s(dhp, env)
    ctx.fig("predicted_step_s", predicted)
    try:
        import ray  # noqa: F401
    except ImportError:
        ctx.note("ray is not importable (its wheel is ~79 MB, too big to ship in .whl/): dhp train skipped")
        return "skipped: no ray" if plan.returncode == 0 else "fail"
    if not ctx.cuda:
        ctx.note("no CUDA: dhp train on a GPU recipe skipped (the CPU recipes are covered by make test)")
        return "skipped: no CUDA" if plan.returncode == 0 else "fail"
    out_dir = Path(args.out).parent / "train_runs"
    run = subprocess.run(
        [*dhp, "train", *TRAIN_OVERRIDES, f"train.output_dir={out_dir}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=args.train_timeout,
    )
    ctx.fig("train_rc", run.returncode)
    ctx.fig("train_output", tail(run.stdout + run.stderr, 2000))
    metrics = sorted(out_dir.glob("*/*/metrics.jsonl"))
    if metrics:
        rows = [json.loads(line) for line in metrics[-1].read_text().strip().splitlines()]
        ctx.fig("train_last_metrics", rows[-1])
        steps = [r["step_s"] for r in rows if "step_s" in r and "loss" in r][1:]  # the first compiles
        if steps and predicted:
            measured = statistics.median(steps)
            ctx.fig("measured_step_s", measured)
            ctx.fig("measured_over_predicted", measured / predicted)
    return "pass" if run.returncode == 0 and metrics else "fail"


def _predicted_step_s(dhp: list[str], env: dict[str, str]) -> float | None:
    """The planner's ``estimate.step_time_s`` for TRAIN_OVERRIDES (None if the plan cannot be read)."""
    res = subprocess.run(
        [*dhp, "plan", *TRAIN_OVERRIDES, "--dry-run", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    try:
        return float(json.loads(res.stdout)["estimate"]["step_time_s"])
    except (ValueError, KeyError, TypeError):
        return None
