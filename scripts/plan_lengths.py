"""The planner's verdicts for the Qwen2.5-VL-32B recipes against image length (no run, no Ray).

For each recipe (SP+TP headline, uniform TP, ZeRO-3) and each length P (patches per sample: 4
synthetic images of P/4 patches, the LLM sequence sized to hold them: P/4 image tokens + 8 markers +
504 text tokens), ``compile_plan`` gives the predicted vision tokens/s, the peak GiB of the fullest
GPU, whether it fits, the peak phase and each module's time split. Nothing is measured or fitted:
this is the model's mechanisms on the recipe's cluster profile (defaults for 8x H100).

    .venv/bin/python scripts/plan_lengths.py --out runs/plan_lengths.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RECIPES = ("qwen_vl_32b", "qwen_vl_32b_tp", "qwen_vl_32b_zero3")
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)


def overrides(patches: int) -> list[str]:
    per_image = patches // 4
    return [
        f"data.synthetic.patches={per_image}",
        "data.synthetic.images_per_sample=4",
        f"modules.vision.seq_len={patches}",
        f"modules.llm.seq_len={per_image + 8 + 504}",
    ]


def row(recipe: str, patches: int) -> dict:
    from dhp.plan import compile_plan
    from dhp.validation import load_config

    plan = compile_plan(load_config(recipe, overrides(patches)))
    doc = plan.to_json()
    est = doc["estimate"]
    dev = max(doc["devices"], key=lambda d: d["total"])
    peak = dev["total"]
    return {
        "recipe": recipe,
        "patches": patches,
        "vision_tokens_per_s": est["vision_tokens_per_s"],
        "step_time_s": est["step_time_s"],
        "peak_gib": peak / 2**30,
        "fits": doc["fits"],
        "peak_phase": dev["peak_phase"],
        "budget_gib": dev["budget"] / 2**30,
        "peak_terms_gib": {k: v / 2**30 for k, v in dev["peak_terms"].items()},
        "modules": est["modules"],
        "bottleneck": est["bottleneck"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = [row(r, p) for p in LENGTHS for r in RECIPES]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    head = " | ".join(f"{r} tok/s / GiB" for r in RECIPES)
    print(f"| patches | {head} |")
    print("|---" * (len(RECIPES) + 1) + "|")
    for p in LENGTHS:
        cells = []
        for r in RECIPES:
            x = next(y for y in rows if y["recipe"] == r and y["patches"] == p)
            oom = "" if x["fits"] else " OOM"
            cells.append(f"{x['vision_tokens_per_s']:,.0f} / {x['peak_gib']:.1f}{oom} ({x['peak_phase']})")
        print(f"| {p} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
