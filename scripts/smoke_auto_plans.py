"""Smoke-train the top plans ``dhp plan --auto`` offers for recipes: does every offered plan train?

For each recipe, the ``--top`` plans of ``dhp plan conf=RECIPE --auto`` are shrunk as ``smoke=true``
shrinks any recipe (tiny model, 4 local gloo ranks, every degree > 1 scaled to 2), which maps several
full-size plans onto one CPU run; each distinct shrunk plan is trained once with
``dhp train conf=RECIPE smoke=true <the plan's overrides>``, and one line per full-size plan says
which run covered it and whether it trained.

    python scripts/smoke_auto_plans.py qwen_vl_32b qwen_vl_7b --top 10 --out runs/smoke_auto

Minutes per distinct shrunk plan on a 2-core box (one Ray start and 2 training steps each); not a
test of the suite.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from dhp.layout import module_layout
from dhp.plan.search import apply, auto_plan
from dhp.validation import load_config


def _key(recipe: str, overrides: list[str]) -> str:
    """The shrunk run's plan: placement and each module's degrees and AC after ``smoke=true``."""
    cfg = load_config(recipe, overrides, smoke=True)
    mods = []
    for name, m in cfg.modules.items():
        p = module_layout(m)
        mods.append(f"{name}:dp{p.dp}fsdp{p.fsdp}sp{p.sp}tp{p.tp}z{p.zero}{'+sp' if p.sequence_parallel else ''}"
                    f"/{m.activation_checkpointing}")  # fmt: skip
    return f"{cfg.placement} " + " ".join(mods)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--out", default="runs/smoke_auto")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per training run")
    args = ap.parse_args()
    failed = 0
    for recipe in args.recipes:
        config = load_config(recipe, [])
        plans, _ = auto_plan(config, set(), top=args.top)
        runs: dict[str, tuple[int, float]] = {}
        for i, (cand, overrides) in enumerate(plans, 1):
            apply(config, overrides)  # the plan validates as a full-size run (auto_plan checked it)
            key = _key(recipe, overrides)
            if key not in runs:
                t0 = time.time()
                cmd = [sys.executable, "-m", "dhp.cli", "train", f"conf={recipe}", "smoke=true",
                       f"train.output_dir={args.out}", *overrides]  # fmt: skip
                try:
                    rc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = 124
                runs[key] = (rc, time.time() - t0)
            rc, secs = runs[key]
            failed += rc != 0
            status = "trained" if rc == 0 else f"FAILED rc={rc}"
            print(f"{recipe} #{i} {cand.label()} -> smoke [{key}] {status} ({secs:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
