"""Merge the per-check JSON files of ``scripts/gpu_check.sh`` into one document and print a table.

    python scripts/gpu/summary.py PARTS_DIR --out FILE --order env,flash,... [--log LOG]

A check without a result file (killed by its timeout, crashed before writing) counts as failed,
with the exit code the shell recorded in ``PARTS_DIR/<check>.rc``. Exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KEY_FIGURES = {
    "env": ["gpu", "torch", "torch_cuda", "matmul_bf16_tflops"],
    "bf16": ["tiny.loss_rel_diff", "mid_7b_widths_2l.loss_rel_diff", "mid_7b_widths_2l.grad_norm_rel_diff"],
    "nccl": ["world1.backend", "tp1.ok", "sp1.ok", "zero1.ok", "nccl2.verdict"],
    "ipc": ["transport_module", "bytes_equal", "event_order.ok", "event_order.pack_nonblocking"],
    "flash": ["flash_attn"],
    "deltanet": ["kernel", "rel_err.delta_rule.out", "rel_err.delta_rule.grad_q", "ms_fwd_bwd.dispatched"],
    "grouped": ["grouped_mm_used", "rel_err.d_gate_up", "empty_expert_grad_max_abs"],
    "mfu": ["step_s", "tokens_per_s_text", "achieved_tflops", "mfu", "peak_mem_gib"],
    "train": ["plan_rc", "train_rc"],
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("parts", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--order", required=True)
    ap.add_argument("--mode", default="gpu")
    args = ap.parse_args()
    results = {}
    for name in args.order.split(","):
        f = args.parts / f"{name}.json"
        rc_file = args.parts / f"{name}.rc"
        rc = rc_file.read_text().strip() if rc_file.exists() else "?"
        if f.exists():
            results[name] = json.loads(f.read_text())
        else:
            why = {
                "124": "timed out",
                "137": "killed (timeout or memory)",
                "skip": "not run: global deadline",
            }
            status = "fail"  # a check that did not finish is not verified
            results[name] = {
                "check": name,
                "status": status,
                "status_text": why.get(rc, f"no result (rc={rc})"),
            }
        results[name]["rc"] = rc
    failed = [n for n, r in results.items() if r["status"] == "fail"]
    doc = {"mode": args.mode, "ok": not failed, "failed": failed, "checks": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, default=str))
    print("\n== summary")
    for name, r in results.items():
        figs = r.get("figures", {})
        shown = []
        for k in KEY_FIGURES.get(name, []):
            if k in figs:
                v = figs[k]
                shown.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
        if name == "ipc":
            shown += [f"{k}={v:.3g}" for k, v in figs.items() if k.endswith("_GBps")]
        wall = r.get("wall_s", "-")
        print(f"  {name:6s} {r.get('status_text', r['status']):28s} {wall!s:>7s}s  {'; '.join(shown)[:220]}")
    print(f"== {'ALL OK' if not failed else 'FAILED: ' + ', '.join(failed)}  ({args.out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
