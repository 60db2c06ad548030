"""The checks behind ``scripts/gpu_check.sh``: one check per process, one JSON result per check.

    python scripts/gpu/checks.py CHECK --out FILE [--cpu]

CHECK is one of env, bf16, nccl, ipc, flash, deltanet, grouped, mfu, train. ``--cpu`` (or a machine without CUDA)
runs tiny sizes on the CPU: checks that need CUDA report ``skipped: no CUDA`` after exercising
their harness on CPU tensors / gloo, so the script's logic can be tested anywhere.
The result is ``{"check", "status": pass|fail|skipped, "figures": {...}, "notes": [...]}``; an
exception inside a check becomes ``fail`` with the traceback's tail. Not part of the pytest suite.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from check_bf16 import check_bf16  # noqa: E402
from check_deltanet import check_deltanet  # noqa: E402
from check_env import check_env, check_flash  # noqa: E402
from check_grouped import check_grouped  # noqa: E402
from check_helpers import Ctx, say, tail  # noqa: E402
from check_ipc import check_ipc  # noqa: E402
from check_mfu import check_mfu  # noqa: E402
from check_nccl import check_nccl, nccl2_rank  # noqa: E402
from check_train import check_train  # noqa: E402

# ---------------------------------------------------------------------------------------------

CHECKS = {
    "env": check_env,
    "bf16": check_bf16,
    "nccl": check_nccl,
    "ipc": check_ipc,
    "flash": check_flash,
    "deltanet": check_deltanet,
    "grouped": check_grouped,
    "mfu": check_mfu,
    "train": check_train,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("check", choices=[*CHECKS, "_nccl2_rank"])
    ap.add_argument("--out", default=None, help="JSON result file")
    ap.add_argument("--cpu", action="store_true", help="dry mode: tiny sizes on the CPU")
    ap.add_argument("--llm-layers", type=int, default=8, help="mfu: LLM layers at 7B widths")
    ap.add_argument("--vision-depth", type=int, default=32, help="mfu: encoder blocks (7B encoder: 32)")
    ap.add_argument(
        "--widths", choices=["auto", "7b"], default="auto", help="mfu: 7b forces 7B widths on CPU"
    )
    ap.add_argument(
        "--grid", type=int, default=0, help="mfu: image grid side in patches (0: 64 = 4096 patches)"
    )
    ap.add_argument("--text", type=int, default=2048, help="mfu: text tokens with --grid")
    ap.add_argument("--nccl2-timeout", type=int, default=40)
    ap.add_argument("--train-timeout", type=int, default=150)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    if args.check == "_nccl2_rank":
        return nccl2_rank(args)
    ctx = Ctx(args.cpu)
    say(f"== {args.check} ({'cuda' if ctx.cuda else 'cpu dry mode'})")
    t0 = time.perf_counter()
    try:
        status = CHECKS[args.check](ctx, args)
        error = None
    except Exception as e:
        traceback.print_exc()
        status, error = "fail", tail(f"{type(e).__name__}: {e}\n{traceback.format_exc()}", 3000)
    status, status_text = status.split(":")[0], status
    result = {
        "check": args.check,
        "status": status,
        "status_text": status_text,
        "device": "cuda" if ctx.cuda else "cpu",
        "wall_s": round(time.perf_counter() - t0, 2),
        "figures": ctx.figures,
        "notes": ctx.notes,
        "error": error,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    say(f"== {args.check}: {status_text} ({result['wall_s']} s)")
    return 0 if status in ("pass", "skipped") else 1


if __name__ == "__main__":
    sys.exit(main())
