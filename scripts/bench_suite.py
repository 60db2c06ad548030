#!/usr/bin/env python
"""The strategy comparison: vision tokens/s and peak memory per rank against image length.

Usage (CPU, tiny shapes, about 5-10 minutes on 2 cores):
    python scripts/bench_suite.py --out bench_out
GPU (real shapes; one H200 or an 8-GPU node, see the README "Benchmark" section):
    python scripts/bench_suite.py --out bench_gpu --conf qwen_vl_7b --gpus 8 \
        --lengths 4096 16384 65536 --steps 5 cluster=h100_8x

Strategies (each module's degrees = --gpus, or 2 on CPU):
- sp_tp:   collocated, vision Ulysses SP + LLM TP (dhp's headline plan);
- tp_tp:   collocated, uniform TP for both modules (Megatron-style);
- fsdp:    collocated, FSDP (ZeRO-3) for both modules;
- disagg:  vision SP and LLM TP on disjoint GPUs (placement=disaggregated), --gpus each.
Image length = patches per image (synthetic data: a square image of that many 14 px patches);
each micro-batch holds ``train.micro_batch_size`` images per replica.

Measured per (strategy, length): median vision tokens/s (encoder patches / step wall time) over the
steps after the warm-up, and peak memory per rank (max over steps; cuda: allocated bytes; cpu: the
process's RSS high-water mark, which includes the Python/torch runtime, ~0.4 GiB). Predicted: the
planner's per-device memory total (``plan.devices[*].total``) and, when the plan carries one, its
step-time / tokens-per-second estimate. A missing estimate field is said so in the JSON
(``predicted.missing``) and in the plot's legend, never filled in.

Writes ``<out>/bench_suite.json`` and ``<out>/tokens_per_s.png``, ``<out>/peak_memory.png``.
One local Ray serves every configuration; a configuration that fails (e.g. OOM, or a plan the
planner refuses) is recorded with its error and the suite goes on.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

STRATEGIES = ("sp_tp", "tp_tp", "fsdp", "disagg")
LABELS = {
    "sp_tp": "collocated: vision SP + LLM TP",
    "tp_tp": "uniform TP",
    "fsdp": "FSDP / ZeRO-3",
    "disagg": "disaggregated: vision SP | LLM TP",
}
# where a planner estimate of throughput may live in plan.json, first match wins
TIME_FIELDS = (
    ("estimate", "tokens_per_s_vision"),
    ("time", "tokens_per_s_vision"),
    ("estimate", "step_s"),
    ("time", "step_s"),
    ("step_time", "step_s"),
)


def strategy_overrides(name: str, n: int) -> list[str]:
    """Hydra overrides putting both modules on ``n`` devices with strategy ``name``."""
    deg = lambda m, **d: [f"modules.{m}.parallel.{a}={d.get(a, 1)}" for a in ("dp", "fsdp", "sp", "tp")]  # noqa: E731
    gpus = [f"modules.vision.gpus={n}", f"modules.llm.gpus={n}"]
    if name == "sp_tp":
        return ["placement=collocated", *gpus, *deg("vision", sp=n), *deg("llm", tp=n)]
    if name == "tp_tp":
        return ["placement=collocated", *gpus, *deg("vision", tp=n), *deg("llm", tp=n)]
    if name == "fsdp":
        return ["placement=collocated", *gpus, *deg("vision", fsdp=n), *deg("llm", fsdp=n)]
    if name == "disagg":
        return ["placement=disaggregated", *gpus, *deg("vision", sp=n), *deg("llm", tp=n)]
    raise ValueError(name)


def length_overrides(patches: int, *, micro: int, text: int, merge: int = 4) -> list[str]:
    """Synthetic images of ``patches`` patches; sequence lengths sized to hold a micro-batch."""
    return [
        "data.kind=synthetic",
        f"data.synthetic.patches={patches}",
        "data.synthetic.images_per_sample=1",
        f"data.synthetic.text_tokens={text}",
        f"modules.vision.seq_len={patches * micro}",
        f"modules.llm.seq_len={patches // merge + text + 8}",
    ]


def predicted(plan: dict[str, Any]) -> dict[str, Any]:
    """The planner's estimates read from plan.json; ``missing`` names what the plan does not carry."""
    out: dict[str, Any] = {"missing": []}
    devices = plan.get("devices")  # plan.json (data), not a config
    if devices and all("total" in d for d in devices):
        out["peak_bytes_per_device"] = {str(d["global_gpu"]): d["total"] for d in devices}
    else:
        out["missing"].append("devices[*].total (memory per device)")
    for outer, inner in TIME_FIELDS:
        if isinstance(plan.get(outer), dict) and inner in plan[outer]:  # plan.json, not a config
            out[inner] = plan[outer][inner]
            out["time_field"] = f"{outer}.{inner}"
            break
    else:
        out["missing"].append(
            "a step-time / tokens-per-s estimate (" + ", ".join(f"{a}.{b}" for a, b in TIME_FIELDS) + ")"
        )
    return out


def measure(conf: str, overrides: list[str], *, steps: int, warmup: int) -> dict[str, Any]:
    """Run ``warmup + steps`` steps of one configuration; medians after the warm-up."""
    from dhp.data import build_run_loader
    from dhp.metrics.record import build_record
    from dhp.plan import compile_plan
    from dhp.plan.compile import module_layouts
    from dhp.runtime import Trainer
    from dhp.validation import load_config

    cfg = load_config(conf, [*overrides, f"train.steps={steps + warmup}", "train.warmup_steps=0"])
    plan = compile_plan(cfg)
    pred = predicted(plan.to_json())
    loader = build_run_loader(cfg, module_layouts(cfg))
    devices = len({r.global_gpu for g in plan.groups for r in g.ranks})
    trainer = Trainer(cfg, plan)
    recs = []
    try:
        for step in range(1, steps + warmup + 1):
            data = next(loader)
            res = trainer.step(data, lr=cfg.train.lr)
            rec = build_record(
                step=step,
                result=res,
                data=data,
                lr=cfg.train.lr,
                base_lr=cfg.train.lr,
                model=cfg.model,
                modules=dict(cfg.modules),
                cluster=cfg.cluster,
                world_devices=devices,
            )
            recs.append(rec)
    finally:
        trainer.close()
        loader.close()
    kept = recs[warmup:]
    peaks: dict[str, int] = {}
    for r in kept:
        for k, v in r["peak_mem_bytes"].items():
            peaks[k] = max(peaks.get(k, 0), v)
    return {
        "tokens_per_s_vision": statistics.median(r["tokens_per_s_vision"] for r in kept),
        "step_s": statistics.median(r["step_s"] for r in kept),
        "loss": kept[-1]["loss"],
        "peak_mem_bytes": peaks,
        "predicted": pred,
        "plan_fits": plan.to_json()["fits"],
    }


def plot(results: list[dict[str, Any]], out: Path, *, device: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    colours = dict(zip(STRATEGIES, ("tab:blue", "tab:orange", "tab:green", "tab:red"), strict=True))
    paths = []
    missing_time = sorted({m for r in ok for m in r["predicted"]["missing"] if "step-time" in m})

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for s in STRATEGIES:
        rows = sorted((r for r in ok if r["strategy"] == s), key=lambda r: r["patches"])
        if not rows:
            continue
        ax.plot(
            [r["patches"] for r in rows],
            [r["tokens_per_s_vision"] for r in rows],
            "o-",
            color=colours[s],
            label=f"{LABELS[s]} (measured)",
        )
        pred = [r for r in rows if "tokens_per_s_vision" in r["predicted"]]
        if pred:
            ax.plot(
                [r["patches"] for r in pred],
                [r["predicted"]["tokens_per_s_vision"] for r in pred],
                "x--",
                color=colours[s],
                label=f"{LABELS[s]} (planner)",
            )
    for r in results:
        if "error" in r:
            ax.plot([r["patches"]], [0], "k^", ms=8)
            ax.annotate(f"{r['strategy']} failed", (r["patches"], 0), fontsize=7, rotation=45)
    if missing_time:
        ax.plot([], [], " ", label="planner: no throughput estimate in plan.json (not plotted)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("image length (patches per image)")
    ax.set_ylabel("vision tokens / s (patches / step wall time)")
    ax.set_title(f"vision throughput by strategy ({device})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "tokens_per_s.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
    measured = "CUDA allocated peak" if device == "cuda" else "CPU RSS high-water, incl. the runtime"
    for s in STRATEGIES:
        rows = sorted((r for r in ok if r["strategy"] == s), key=lambda r: r["patches"])
        if not rows:
            continue
        mem = [max(r["peak_mem_bytes"].values()) / 2**20 for r in rows]
        ax.plot([r["patches"] for r in rows], mem, "o-", color=colours[s], label=f"{LABELS[s]} (measured)")
        ax2.plot(
            [r["patches"] for r in rows],
            [m - mem[0] for m in mem],
            "o-",
            color=colours[s],
            label=f"{LABELS[s]} (measured)",
        )
        pred = [r for r in rows if "peak_bytes_per_device" in r["predicted"]]
        if pred:
            pm = [max(r["predicted"]["peak_bytes_per_device"].values()) / 2**20 for r in pred]
            ax.plot([r["patches"] for r in pred], pm, "x--", color=colours[s], label=f"{LABELS[s]} (planner)")
            ax2.plot(
                [r["patches"] for r in pred],
                [m - pm[0] for m in pm],
                "x--",
                color=colours[s],
                label=f"{LABELS[s]} (planner)",
            )
    if any("peak_bytes_per_device" not in r["predicted"] for r in ok):
        ax2.plot([], [], " ", label="planner: no per-device memory in some plans (not plotted)")
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xlabel("image length (patches per image)")
        a.grid(alpha=0.3, which="both")
    ax.set_yscale("log")
    ax.set_ylabel(f"MiB, max over ranks\n(measured: {measured}; planner: its estimate)", fontsize=8)
    ax.set_title(f"peak memory per rank ({device})", fontsize=10)
    ax2.set_ylabel("MiB above the shortest length", fontsize=8)
    ax2.set_title("growth with image length (the runtime's constant cancels)", fontsize=10)
    ax2.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    paths.append(out / "peak_memory.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def main(argv: list[str]) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--conf", default="tiny_vlm")
    ap.add_argument("--gpus", type=int, default=2, help="devices per module (each strategy's degree)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024], help="patches per image")
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--text-tokens", type=int, default=32)
    args, extra = ap.parse_known_args(argv)  # extra: key=value overrides for every configuration
    import ray

    from dhp.validation import load_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = load_config(args.conf, extra)
    micro = base.train.micro_batch_size
    device = base.cluster.device
    if device == "cpu":
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    results = []
    t_all = time.monotonic()
    try:
        for s in args.strategies:
            for p in args.lengths:
                side = math.isqrt(p)
                assert side * side == p, f"--lengths must be square patch counts, got {p}"
                ov = [
                    *extra,
                    *strategy_overrides(s, args.gpus),
                    *length_overrides(p, micro=micro, text=args.text_tokens),
                ]
                t0 = time.monotonic()
                row: dict[str, Any] = {"strategy": s, "label": LABELS[s], "patches": p, "overrides": ov}
                try:
                    row |= measure(args.conf, ov, steps=args.steps, warmup=args.warmup)
                except Exception as e:  # one failed configuration must not lose the others
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                row["seconds"] = time.monotonic() - t0
                results.append(row)
                tps = row.get("tokens_per_s_vision")
                mem = max(row["peak_mem_bytes"].values()) / 2**20 if "peak_mem_bytes" in row else float("nan")
                print(
                    f"{s:7s} patches={p:6d}  vision tok/s={tps if tps is None else round(tps):>8}  "
                    f"peak={mem:8.0f} MiB  {row.get('error', '')}  ({row['seconds']:.0f}s)",
                    flush=True,
                )
    finally:
        if ray.is_initialized():
            ray.shutdown()
    doc = {
        "conf": args.conf,
        "device": device,
        "gpus_per_module": args.gpus,
        "lengths": args.lengths,
        "steps": args.steps,
        "warmup": args.warmup,
        "overrides": extra,
        "results": results,
        "seconds": time.monotonic() - t_all,
    }
    (out / "bench_suite.json").write_text(json.dumps(doc, indent=1))
    pngs = plot(results, out, device=device)
    print(f"wrote {out / 'bench_suite.json'} and {', '.join(str(p) for p in pngs)} in {doc['seconds']:.0f}s")
    return doc


if __name__ == "__main__":
    main(sys.argv[1:])
