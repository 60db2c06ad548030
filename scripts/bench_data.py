#!/usr/bin/env python
"""Data loading time per sample at 448 px and 1792 px (real photographs), on this machine.

python scripts/bench_data.py [--sides 448 1792] [--repeats 2] [--model-path DIR] [--json OUT.json]
python scripts/bench_data.py --engine local ray --workers 1 2 [--steps 4] [--sides 448 1792]

Each of the 16 demo photographs is resized to side x side (JPEG, quality 90) into a temporary LLaVA
dataset with its caption. A sample's load time is what the loader pays per sample: JPEG decode,
transformers' Qwen2-VL image processor (resize, normalise, patchify) with max_pixels = side^2,
chat-template rendering, tokenization and image-token expansion. The breakdown times the three
stages separately on the same samples. Synthetic samples of the same patch counts are timed too.
Without --model-path a tiny checkpoint (tokenizer + preprocessor config) is written to a temp dir.

With --engine, the step loader itself is timed instead, per engine, worker count and side: a
global batch of 8 over 2 data replicas, ``--steps`` steps after one warm-up step (actor start-up
and imports excluded). ``samples_per_s`` is samples handed out over wall time; ``driver_cpu_s_per_step``
is this process's CPU time (all its threads: the loader's prefetch thread, the local engine's
workers, Ray's client threads) per step. Under ``ray`` the samples are processed by data actors and
the pixels stay in the object store, so the driver pays for indices and metadata only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from PIL import Image

from dhp.config.schema import DataConfig, DatasetEntry, SyntheticData
from dhp.data.llava import resolve_path
from dhp.data.processing import open_image
from dhp.data.source import build_source

DEMO = "pkg://dhp.data_assets/demo"


def make_dataset(root: Path, side: int) -> Path:
    """The 16 single-image caption samples of the demo set, photographs resized to side x side."""
    demo = resolve_path(DEMO, key="demo")
    records = [r for r in json.loads((demo / "captions.json").read_text()) if r["id"].startswith("caption-")]
    (root / "images").mkdir(parents=True)
    for r in records:
        with Image.open(demo / "images" / r["image"]) as im:
            im.convert("RGB").resize((side, side), Image.BICUBIC).save(
                root / "images" / r["image"], quality=90
            )
    (root / "data.json").write_text(json.dumps(records))
    return root / "data.json"


def time_llava(model, side: int, repeats: int, tmp: Path) -> dict:
    path = make_dataset(tmp / f"side{side}", side)
    data = DataConfig(
        kind="llava",
        datasets=[DatasetEntry(name="bench", path=str(path), image_root=str(path.parent / "images"))],
        max_pixels=side * side,
    )
    src, _, _ = build_source(data=data, model=model, patch_seq_len=1 << 20, token_seq_len=1 << 20, seed=0)
    src.load(0)  # warm-up: first-call imports and caches
    totals, cpu, decode, process, text, patches = [], [], [], [], [], set()
    proc = src.processor
    for _ in range(repeats):
        for i in range(len(src)):
            t0, c0 = time.perf_counter(), time.process_time()
            sample = src.load(i)
            totals.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            patches.add(sample.num_patches)
            record = src.datasets[0].record(i)
            t0 = time.perf_counter()
            im = open_image(record.images[0], loc=record.location)
            t1 = time.perf_counter()
            proc.image_processor(images=[im], return_tensors="pt")
            t2 = time.perf_counter()
            proc._tokenize(record)
            t3 = time.perf_counter()
            decode.append(t1 - t0)
            process.append(t2 - t1)
            text.append(t3 - t2)
    ms = lambda xs: round(1e3 * statistics.mean(xs), 2)  # noqa: E731
    return {
        "side_px": side,
        "patches_per_image": sorted(patches),
        "samples_timed": len(totals),
        "ms_per_sample_mean": ms(totals),
        "ms_per_sample_p50": round(1e3 * statistics.median(totals), 2),
        "ms_per_sample_max": round(1e3 * max(totals), 2),
        "cpu_ms_per_sample_mean": ms(cpu),  # process CPU time: less sensitive to a shared, loaded box
        "breakdown_ms": {
            "decode_jpeg": ms(decode),
            "image_processor": ms(process),
            "template_tokenize": ms(text),
        },
    }


def time_synthetic(model, side: int, repeats: int) -> dict:
    patches = (side // 14) ** 2
    data = DataConfig(
        kind="synthetic", synthetic=SyntheticData(num_samples=8, patches=patches, text_tokens=128)
    )
    src, _, _ = build_source(data=data, model=model, patch_seq_len=1 << 20, token_seq_len=1 << 20, seed=0)
    src.load(0)
    times = []
    for _ in range(repeats):
        for i in range(len(src)):
            t0 = time.perf_counter()
            src.load(i)
            times.append(time.perf_counter() - t0)
    return {"side_px": side, "patches": patches, "ms_per_sample_mean": round(1e3 * statistics.mean(times), 2)}


def time_engine(model, side: int, engine: str, workers: int, steps: int, tmp: Path) -> dict:
    """Samples/s and the driver's CPU seconds per step of the step loader under ``engine``."""
    from dhp.config.schema import TrainConfig
    from dhp.data.loader import build_loader

    root = tmp / f"engine{side}"
    path = root / "data.json" if root.exists() else make_dataset(root, side)
    data = DataConfig(
        kind="llava",
        datasets=[DatasetEntry(name="bench", path=str(path), image_root=str(path.parent / "images"))],
        max_pixels=side * side,
        engine=engine,
        num_workers=workers,
        prefetch_depth=2,
    )
    train = TrainConfig(global_batch_size=8, micro_batch_size=1, seed=0)
    loader = build_loader(
        data=data, model=model, train=train, dp_size=2, patch_seq_len=1 << 20, token_seq_len=1 << 20
    )
    try:
        next(loader)  # warm-up: actors, imports, caches
        t0, c0 = time.perf_counter(), time.process_time()
        waits = []
        for _ in range(steps):
            waits.append(next(loader).metrics["wait_s"])
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        loader.close()
    return {
        "engine": engine,
        "workers": workers,
        "side_px": side,
        "steps": steps,
        "samples_per_s": round(steps * 8 / wall, 3),
        "driver_cpu_s_per_step": round(cpu / steps, 4),
        "wall_s_per_step": round(wall / steps, 3),
        "data_wait_s_per_step": round(statistics.mean(waits), 3),
    }


def bench_engines(args, model, tmp: Path) -> dict:
    import ray

    ray.init(address="local", num_cpus=max(args.workers), include_dashboard=False, log_to_driver=False)
    try:
        rows = [
            time_engine(model, side, engine, w, args.steps, tmp)
            for side in args.sides
            for engine in args.engine
            for w in args.workers
        ]
    finally:
        ray.shutdown()
    for r in rows:
        print(
            f"{r['side_px']:>5} px {r['engine']:>5} x{r['workers']}: {r['samples_per_s']:7.2f} samples/s, "
            f"driver CPU {r['driver_cpu_s_per_step']:.3f} s/step, wall {r['wall_s_per_step']:.2f} s/step"
        )
    out: dict = {"engines": rows}
    for side in args.sides:
        by = {(r["engine"], r["workers"]): r for r in rows if r["side_px"] == side}
        for w in args.workers:
            if ("local", w) in by and ("ray", w) in by:
                ratio = by[("ray", w)]["driver_cpu_s_per_step"] / max(
                    by[("local", w)]["driver_cpu_s_per_step"], 1e-9
                )
                out[f"driver_cpu_ray_over_local_{side}px_{w}w"] = round(ratio, 4)
                print(f"{side:>5} px, {w} worker(s): driver CPU ray/local = {100 * ratio:.1f} %")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sides", type=int, nargs="+", default=[448, 1792])
    parser.add_argument("--repeats", type=int, default=2, help="passes over the 16 photographs per side")
    parser.add_argument("--model-path", default=None, help="HF dir with tokenizer + preprocessor_config.json")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the results to this file")
    parser.add_argument("--engine", nargs="+", choices=["local", "ray"], default=None, help="time the loader")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="with --engine: data workers")
    parser.add_argument("--steps", type=int, default=4, help="with --engine: timed steps of 8 samples")
    args = parser.parse_args()
    from dhp.models import get_family, make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model_path = args.model_path or str(make_tiny_checkpoint(tmp / "tiny"))
        model = replace(get_family("qwen2_5_vl").tiny_model_config(), path=model_path)
        if args.engine:
            results = bench_engines(args, model, tmp)
            results["load_average_1m"] = os.getloadavg()[0]
            results["cpu_count"] = os.cpu_count()
            print(json.dumps(results))
            if args.json_out:
                Path(args.json_out).write_text(json.dumps(results, indent=1) + "\n")
            return
        results = {
            "llava_real_photos": [time_llava(model, s, args.repeats, tmp) for s in args.sides],
            "synthetic": [time_synthetic(replace(model, path=None), s, args.repeats) for s in args.sides],
        }
    for r in results["llava_real_photos"]:
        b = r["breakdown_ms"]
        print(
            f"{r['side_px']:>5} px ({r['patches_per_image'][0]} patches): {r['ms_per_sample_mean']:8.1f} ms/sample "
            f"[cpu {r['cpu_ms_per_sample_mean']:.1f}] "
            f"(p50 {r['ms_per_sample_p50']:.1f}, max {r['ms_per_sample_max']:.1f}; decode {b['decode_jpeg']:.1f}, "
            f"image processor {b['image_processor']:.1f}, template+tokenize {b['template_tokenize']:.1f}) "
            f"over {r['samples_timed']} samples"
        )
    for r in results["synthetic"]:
        print(
            f"{r['side_px']:>5} px synthetic ({r['patches']} patches): {r['ms_per_sample_mean']:8.1f} ms/sample"
        )
    results["load_average_1m"] = os.getloadavg()[0]
    results["cpu_count"] = os.cpu_count()
    print(json.dumps(results))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
