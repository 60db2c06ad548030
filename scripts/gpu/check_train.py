"""``dhp plan`` of a 1-GPU recipe; ``dhp train`` where Ray is importable."""

from __future__ import annotations

import json
import os
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
    "train.steps=3",
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
        last = metrics[-1].read_text().strip().splitlines()[-1]
        ctx.fig("train_last_metrics", json.loads(last))
    return "pass" if run.returncode == 0 and metrics else "fail"
