"""Measure the optimizer phase's memory peak of each AdamW implementation on CPU, against the planner.

One process per ``train.optimizer.impl`` (fused, foreach, for_loop) builds the real ``dhp.models``
LLM of a widened ``tiny_vlm`` (hidden 1024, 4 layers: ~50 M fp32 parameters, so the tensors dwarf
the process's own noise), gives every parameter a gradient, builds the optimizer with
``dhp.parallel.build_optimizer`` and takes one step (the states now exist). The peak of a second
step is then read from the kernel: ``/proc/self/clear_refs`` resets VmHWM, the step runs, VmHWM -
VmRSS before it is what the step allocated on top of the resident params, grads and states, including
whatever a fused kernel allocates inside ATen, which a dispatch-level tracker would not see. glibc's
malloc must hand every large block back to the kernel for this: ``MALLOC_MMAP_THRESHOLD_=65536``
(set for the child) maps every block over 64 KiB and unmaps it on free.

measured peak = bytes of the params, grads and AdamW states (their storages) + the step's temporaries;
predicted peak = the planner's live bytes of that rank in its ``optimizer`` phase
(``dhp.plan.phases.ModuleTerms.live``: params + grads + optimizer + optimizer_temp).

    .venv/bin/python scripts/measure_optimizer_memory.py [--out runs/optimizer_memory.json]
    (also: scripts/bench_planner.py --optimizer)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

IMPLS = ("fused", "foreach", "for_loop")
WIDE = [
    "model.llm.hidden_size=1024",
    "model.llm.intermediate_size=2816",
    "model.llm.num_layers=4",
    "model.llm.num_heads=8",
    "model.llm.num_kv_heads=4",
    "model.llm.mrope_section=[16,24,24]",
    "placement=disaggregated",
    "modules.vision.gpus=1",
    "modules.vision.parallel.sp=1",
    "modules.llm.gpus=1",
    "modules.llm.parallel.tp=1",
]
BOUND = 0.10  # measured vs predicted optimizer-phase peak, relative


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def child(impl: str) -> dict:
    """Measure one implementation in this process (see the module docstring)."""
    import torch

    from dhp.layout import module_layout
    from dhp.models import get_family
    from dhp.parallel import build_optimizer
    from dhp.plan.compile import micro_batches_per_step, module_shapes
    from dhp.plan.phases import module_terms
    from dhp.validation import load_config

    torch.set_num_threads(1)
    cfg = load_config("tiny_vlm", [*WIDE, f"train.optimizer.impl={impl}"])
    family = get_family(cfg.model.family)
    module = family.build_module("llm", family.hf_config(cfg.model), device="cpu", dtype=torch.float32)
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    layout = module_layout(cfg.modules.llm)
    opt = build_optimizer(module, None, layout=layout, train=cfg.train)  # type: ignore[arg-type]
    opt.step()  # allocates exp_avg / exp_avg_sq
    states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    resident = sum(t.untyped_storage().nbytes() for t in [*params, *(p.grad for p in params), *states])
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    opt.step()
    temp = max(0, _status_kib("VmHWM") - before) * 1024
    shape = module_shapes(cfg)["llm"]
    n_mb = micro_batches_per_step(cfg.train, layout.num_replicas)
    terms = module_terms(shape, micro_batches=n_mb, optimizer_impl=impl)
    live = terms.live("optimizer")
    predicted = sum(live[k] for k in ("params", "grads", "optimizer", "optimizer_temp") if k in live)
    measured = resident + temp
    return {
        "impl": impl,
        "params": sum(p.numel() for p in params),
        "resident_bytes": resident,
        "measured_temp_bytes": temp,
        "predicted_temp_bytes": terms.optim,
        "measured_peak_bytes": measured,
        "predicted_peak_bytes": predicted,
        "ratio": predicted / measured,
    }


def measure_all() -> list[dict]:
    """One child process per implementation (a fresh heap each), with glibc's mmap threshold pinned."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    rows = []
    for impl in IMPLS:
        out = subprocess.run(
            [sys.executable, __file__, "--child", impl], env=env, check=True, capture_output=True, text=True
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def report(rows: list[dict]) -> bool:
    """Print the table; True when every implementation's peak is within BOUND."""
    mib = 1 << 20
    print(
        f"{'impl':9} {'temp meas':>10} {'temp pred':>10} {'peak meas':>10} {'peak pred':>10} {'pred/meas':>9}  (MiB)"
    )
    ok = True
    for r in rows:
        good = abs(r["ratio"] - 1) <= BOUND
        ok &= good
        print(
            f"{r['impl']:9} {r['measured_temp_bytes'] / mib:10.1f} {r['predicted_temp_bytes'] / mib:10.1f} "
            f"{r['measured_peak_bytes'] / mib:10.1f} {r['predicted_peak_bytes'] / mib:10.1f} "
            f"{r['ratio']:9.3f}{'' if good else '  OUT OF BOUND'}"
        )
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    rows = measure_all()
    ok = report(rows)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"optimizer": rows, "bound": BOUND}, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
