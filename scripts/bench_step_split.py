"""Step-time split of a recipe under dhp (compute / hand-off + Ray / driver) vs the single-process loop.

Usage: .venv/bin/python scripts/bench_step_split.py [conf=tiny_vlm] [steps=6] [warmup=2] [key=value ...]

Both sides run the same batches from the same initial weights: dhp through the real runtime
(Ray actor groups, gloo, hand-off), the reference as the unsplit transformers model + AdamW in this
process (``dhp.runtime.verify.compare.ReferenceModel``). Definitions, per step (median over measured steps):
- compute_s: sum over modules of the slowest rank's fwd+bwd+optimizer seconds (worker-timed,
  excluding time spent waiting for hand-off payloads);
- driver_s: driver-side routing and bookkeeping;
- handoff_ray_s: the rest of the step's wall time: payload transport, Ray call latency, and idle
  time of one group while the other computes (step_s - compute_s - driver_s);
- single_s: the single-process step on the same data.
Prints a table and one JSON line (``BENCH {...}``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def main(argv: list[str]) -> dict:
    from dhp.data import build_run_loader
    from dhp.plan import compile_plan
    from dhp.plan.compile import module_layouts
    from dhp.runtime import Trainer
    from dhp.runtime.loop.schedule import WarmupCosine
    from dhp.runtime.verify.compare import ReferenceModel
    from dhp.validation import load_config

    opts = {"conf": "tiny_vlm", "steps": "6", "warmup": "2"}
    overrides = []
    for a in argv:
        k, _, v = a.partition("=")
        if k in opts:
            opts[k] = v
        else:
            overrides.append(a)
    steps, warmup = int(opts["steps"]), int(opts["warmup"])
    cfg = load_config(opts["conf"], [*overrides, f"train.steps={steps + warmup}"])
    plan = compile_plan(cfg)
    loader = build_run_loader(cfg, module_layouts(cfg))
    t = cfg.train
    sched = WarmupCosine(
        lr=t.lr, warmup_steps=t.warmup_steps, total_steps=steps + warmup, min_lr_ratio=t.min_lr_ratio
    )
    trainer = Trainer(cfg, plan)
    rows = []
    try:
        ref = ReferenceModel(
            model=cfg.model, modules=dict(cfg.modules), train=t, initial=trainer.full_state_dict()
        )
        for i in range(steps + warmup):
            data, lr = next(loader), sched.next_lr()
            res = trainer.step(data, lr=lr)
            t0 = time.perf_counter()
            ref_loss, _, _ = ref.step(data, lr=lr)
            single = time.perf_counter() - t0
            compute = sum(
                max(s["fwd_s"] + s["bwd_s"] + s["step_s"] for s in ranks) for ranks in res.stats.values()
            )
            if i >= warmup:
                rows.append(
                    {
                        "step_s": res.step_s,
                        "compute_s": compute,
                        "driver_s": res.driver_s,
                        "handoff_ray_s": max(0.0, res.step_s - compute - res.driver_s),
                        "llm_wait_s": res.consumer_wait_s,
                        "single_s": single,
                        "loss": res.loss,
                        "ref_loss": ref_loss,
                    }
                )
    finally:
        trainer.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out = {
        "conf": opts["conf"],
        "overrides": overrides,
        "steps": steps,
        "plan": [(g.name, g.mesh) for g in plan.groups],
        "placement": cfg.placement,
        "median": med,
    }
    print(f"{'':24}{'seconds':>10}")
    for k in ("step_s", "compute_s", "handoff_ray_s", "driver_s", "llm_wait_s", "single_s"):
        print(f"{k:24}{med[k]:10.4f}")
    print(f"dhp step / single-process step: {med['step_s'] / med['single_s']:.2f}x")
    print("BENCH " + json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
