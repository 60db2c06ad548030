"""Sequence packing vs right-padding: LLM tokens/s and padding fraction on a realistic length mix.

The same samples go through dhp.models' LLMModule (forward + backward, fp32, this machine's device)
twice per micro-batch: right-padded to the longest sample (``dhp.data.batch.collate``), and packed into
rows of ``--max-tokens`` (``dhp.data.packing.pack``, per-sample M-RoPE, attention kept inside each
sample). Lengths follow a long-tailed (log-normal) mix like instruction-tuning data: many short
conversations, a few long ones, clipped to ``[--min-len, --max-len]``; every sample carries one image
of ``--image-tokens`` tokens (random embeddings stand in for the encoder's output). Tokens/s counts
real tokens only (padding excluded), over the timed micro-batches after ``--warmup``.

On CPU the packed rows' attention is SDPA with transformers' block-diagonal mask, which computes
``rows x max_tokens^2`` scores (flash varlen on GPU computes only each sample's own block); the
default shape (hidden 512, rows of 512) keeps attention a minor share of the FLOPs, as in real VLMs
whose hidden size exceeds the sequence share of attention. With a small hidden and long rows
(``--hidden 256 --max-len 1024 --max-tokens 1024``) the CPU gain shrinks.

    .venv/bin/python scripts/bench_packing.py --out runs/bench_packing.json [--quick]

Prints a table and writes ``{"config": ..., "padded": {...}, "packed": {...}, "speedup": x}``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from dhp.data.batch import IGNORE_INDEX, IMAGE, TEXT, Sample, VLBatch, collate
from dhp.data.packing import pack


def length_mix(n: int, *, lo: int, hi: int, median: int, sigma: float, seed: int) -> list[int]:
    """``n`` log-normal lengths (``median``, ``sigma``) clipped to ``[lo, hi]``."""
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randn(n, generator=gen) * sigma + math.log(median)
    return [int(min(hi, max(lo, round(math.exp(float(x)))))) for x in draws]


def make_sample(k: int, n: int, *, hf, image_tokens: int, gen: torch.Generator) -> Sample:
    """A conversation of ``n`` tokens: one image block, then text labelled on its second half."""
    ids = torch.randint(20, hf.text_config.vocab_size, (n,), generator=gen)
    types = torch.full((n,), TEXT, dtype=torch.long)
    ids[0], ids[image_tokens + 1] = hf.vision_start_token_id, hf.vision_end_token_id
    ids[1 : image_tokens + 1] = hf.image_token_id
    types[1 : image_tokens + 1] = IMAGE
    labels = ids.clone()
    labels[: max(image_tokens + 2, n // 2)] = IGNORE_INDEX
    merge = hf.vision_config.spatial_merge_size
    grid = torch.tensor([[1, merge, merge * image_tokens]])
    return Sample(f"mix:{k}", ids, labels, types, image_grid_thw=grid)


def step(module, batch: VLBatch, hidden: int, device: torch.device) -> None:
    n_img = int((batch.mm_token_type_ids == IMAGE).sum())
    embeds = torch.randn(n_img, hidden, device=device).requires_grad_(True)
    out = module(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        labels=batch.labels.to(device),
        mm_token_type_ids=batch.mm_token_type_ids.to(device),
        image_grid_thw=batch.image_grid_thw.to(device),
        image_embeds=embeds,
        sample_ids=batch.sample_ids,
    )
    (out.loss_sum / max(out.num_tokens, 1)).backward()


def progress(msg: str) -> None:
    """One line on stderr per micro-batch: the run is long on a CPU and stdout holds the table."""
    print(msg, file=sys.stderr, flush=True)


def run(module, batches: list[VLBatch], *, warmup: int, hidden: int, device: torch.device, name: str) -> dict:
    """Time forward + backward over ``batches`` (after ``warmup`` untimed ones)."""
    start = time.perf_counter()
    for i, b in enumerate(batches[:warmup], 1):
        step(module, b, hidden, device)
        progress(f"{name}: warm-up {i}/{warmup} ({time.perf_counter() - start:.1f} s)")
    real = total = 0
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    timed = batches[warmup:]
    for i, b in enumerate(timed, 1):
        step(module, b, hidden, device)
        real += int((b.attention_mask > 0).sum())
        total += b.input_ids.numel()
        progress(f"{name}: micro-batch {i}/{len(timed)} ({time.perf_counter() - t0:.1f} s)")
    sync()
    secs = time.perf_counter() - t0
    rows = sum(b.input_ids.shape[0] for b in batches[warmup:])
    return {
        "seconds": secs,
        "real_tokens": real,
        "slot_tokens": total,
        "rows": rows,
        "tokens_per_s": real / secs,
        "padding_fraction": 1 - real / total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench_packing.json")
    ap.add_argument("--micro-batches", type=int, default=6)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=512, help="packed row length (>= --max-len)")
    ap.add_argument("--min-len", type=int, default=48)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--median", type=int, default=128)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--image-tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="4 micro-batches, 1 warm-up (smoke)")
    args = ap.parse_args()
    if args.quick:
        args.micro_batches, args.warmup = 4, 1

    from dhp.models import get_family

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    family = get_family("qwen2_5_vl")
    cfg = family.tiny_model_config()
    cfg.llm.hidden_size, cfg.llm.num_layers = args.hidden, args.layers
    cfg.llm.intermediate_size = 4 * args.hidden
    cfg.llm.num_heads = args.hidden // 16  # head_dim 16: the tiny config's M-RoPE sections (2, 3, 3)
    cfg.llm.num_kv_heads = cfg.llm.num_heads // 2
    hf = family.hf_config(cfg)
    torch.manual_seed(0)
    progress(f"building the {args.layers}-layer LLM (hidden {args.hidden}) on {device}")
    module = family.build_module("llm", hf, device=device, dtype=torch.float32)
    n = args.micro_batches * args.micro_batch_size
    lengths = length_mix(n, lo=args.min_len, hi=args.max_len, median=args.median, sigma=args.sigma, seed=0)
    gen = torch.Generator().manual_seed(1)
    samples = [
        make_sample(k, m, hf=hf, image_tokens=args.image_tokens, gen=gen) for k, m in enumerate(lengths)
    ]
    groups = [samples[i : i + args.micro_batch_size] for i in range(0, n, args.micro_batch_size)]
    pad = hf.text_config.pad_token_id or 0
    padded = [collate(g, pad_token_id=pad) for g in groups]
    packed = [pack(g, max_tokens=args.max_tokens, pad_token_id=pad) for g in groups]
    res = {}
    for name, batches in (("padded", padded), ("packed", packed)):
        hidden = hf.text_config.hidden_size
        res[name] = run(module, batches, warmup=args.warmup, hidden=hidden, device=device, name=name)
    speedup = res["packed"]["tokens_per_s"] / res["padded"]["tokens_per_s"]
    out = {
        "config": {**vars(args), "device": str(device), "lengths_mean": sum(lengths) / n},
        **res,
        "speedup": speedup,
    }
    print(f"length mix: {n} samples, mean {sum(lengths) / n:.0f}, max {max(lengths)} tokens; device {device}")
    print(f"{'':8} {'tokens/s':>10} {'padding':>8} {'rows':>5} {'seconds':>8}")
    for name in ("padded", "packed"):
        r = res[name]
        print(
            f"{name:8} {r['tokens_per_s']:10.0f} {r['padding_fraction']:8.1%} {r['rows']:5d} {r['seconds']:8.2f}"
        )
    print(f"packed / padded tokens/s: {speedup:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
