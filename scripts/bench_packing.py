"""Sequence packing vs right-padding: LLM tokens/s and padding fraction on a realistic length mix, per family.

The same samples go through dhp.models' LLMModule of each family (forward + backward, fp32, this
machine's device) twice per micro-batch: right-padded to the longest sample (``dhp.data.batch.collate``),
and packed into rows of ``--max-tokens`` (``dhp.data.packing.pack``, per-sample M-RoPE, attention kept
inside each sample; Qwen3.5's Gated DeltaNet layers run each sample on its own,
``dhp.parallel.linear_attn_packed``). Lengths follow a long-tailed (log-normal) mix like
instruction-tuning data: many short conversations, a few long ones, clipped to ``[--min-len,
--max-len]``; every sample carries one image of ``--image-tokens`` tokens (random embeddings stand in
for the encoder's output, one per DeepStack level too). Tokens/s counts real tokens only (padding
excluded), over the timed micro-batches after ``--warmup``.

Each family's tiny architecture is scaled to ``--hidden`` x ``--layers`` (MLP 4 x hidden; attention
heads of the tiny head_dim; Qwen3.5: a full-attention layer every 4th, DeltaNet heads of 64 channels,
``hidden / 64`` value and half as many key heads; the MoE flavours keep the tiny 8 experts, top-2, of
``hidden / 2``). On CPU the packed rows' full attention is SDPA with transformers' block-diagonal mask,
which computes ``rows x max_tokens^2`` scores (flash varlen on GPU computes only each sample's own
block); the DeltaNet layers on CPU run transformers' torch fallback once per sample (each padded to the
rule's 64-token chunks on its own). The default shape keeps attention a minor share of the FLOPs, as in
real VLMs.

    .venv/bin/python scripts/bench_packing.py --out runs/bench_packing.json [--family qwen3_5 ...] [--quick]

Prints one table per family and a summary, and writes ``{"config": ..., "families": {name: {"padded":
{...}, "packed": {...}, "speedup": x}}}``.
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


#: the families and flavours benchmarked: name -> (family folder, MoE flavour)
FLAVOURS = {
    "qwen2_5_vl": ("qwen2_5_vl", False),
    "qwen3_vl": ("qwen3_vl", False),
    "qwen3_vl_moe": ("qwen3_vl", True),
    "qwen3_5": ("qwen3_5", False),
    "qwen3_5_moe": ("qwen3_5", True),
}


def scaled_hf_config(name: str, *, hidden: int, layers: int):
    """(family, hf config) of flavour ``name``'s tiny architecture at ``hidden`` x ``layers`` (module docstring)."""
    from dhp.models import get_family
    from dhp.models.entries import model_entry

    folder, moe = FLAVOURS[name]
    family = get_family(folder)
    cfg = model_entry(family.arch.moe.tiny) if moe else family.tiny_model_config()
    t, extra = cfg.llm, cfg.llm.extra
    t.hidden_size, t.num_layers, t.intermediate_size = hidden, layers, 4 * hidden
    head_dim = extra.get("head_dim", 16)  # Qwen2.5-VL: 16, the tiny config's M-RoPE sections (2, 3, 3)
    t.num_heads = hidden // head_dim
    t.num_kv_heads = t.num_heads // 2
    if moe:
        extra["moe_intermediate_size"] = hidden // 2
        if "mlp_only_layers" in extra:
            extra["mlp_only_layers"] = []  # every layer sparse
    if "full_attention_interval" in extra:  # Qwen3.5: 3 DeltaNet layers, then a full one (as released)
        extra["full_attention_interval"] = min(4, layers)
        extra["linear_key_head_dim"] = extra["linear_value_head_dim"] = 64
        extra["linear_num_value_heads"] = hidden // 64
        extra["linear_num_key_heads"] = max(1, hidden // 128)
    return family, family.hf_config(cfg)


def step(module, batch: VLBatch, edges: list[str], hidden: int, device: torch.device) -> None:
    n_img = int((batch.mm_token_type_ids == IMAGE).sum())
    rows = {k: torch.randn(n_img, hidden, device=device).requires_grad_(True) for k in edges}
    out = module(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        labels=batch.labels.to(device),
        mm_token_type_ids=batch.mm_token_type_ids.to(device),
        image_grid_thw=batch.image_grid_thw.to(device),
        sample_ids=batch.sample_ids,
        **rows,
    )
    (out.loss_sum / max(out.num_tokens, 1)).backward()


def progress(msg: str) -> None:
    """One line on stderr per micro-batch: the run is long on a CPU and stdout holds the table."""
    print(msg, file=sys.stderr, flush=True)


def run(
    module,
    batches: list[VLBatch],
    *,
    edges: list[str],
    warmup: int,
    hidden: int,
    device: torch.device,
    name: str,
) -> dict:
    """Time forward + backward over ``batches`` (after ``warmup`` untimed ones)."""
    start = time.perf_counter()
    for i, b in enumerate(batches[:warmup], 1):
        step(module, b, edges, hidden, device)
        progress(f"{name}: warm-up {i}/{warmup} ({time.perf_counter() - start:.1f} s)")
    real = total = 0
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    timed = batches[warmup:]
    for i, b in enumerate(timed, 1):
        step(module, b, edges, hidden, device)
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


def bench_family(name: str, args, device: torch.device) -> dict:
    """Padded vs packed for flavour ``name``: ``{"padded": ..., "packed": ..., "speedup": x}``."""
    family, hf = scaled_hf_config(name, hidden=args.hidden, layers=args.layers)
    torch.manual_seed(0)
    progress(f"{name}: building the {args.layers}-layer LLM (hidden {args.hidden}) on {device}")
    module = family.build_module("llm", hf, device=device, dtype=torch.float32)
    edges = [e.kwarg for e in family.handoffs_for(hf)]  # image_embeds (+ DeepStack levels)
    n = args.micro_batches * args.micro_batch_size
    lengths = length_mix(n, lo=args.min_len, hi=args.max_len, median=args.median, sigma=args.sigma, seed=0)
    gen = torch.Generator().manual_seed(1)
    samples = [
        make_sample(k, m, hf=hf, image_tokens=args.image_tokens, gen=gen) for k, m in enumerate(lengths)
    ]
    groups = [samples[i : i + args.micro_batch_size] for i in range(0, n, args.micro_batch_size)]
    pad = hf.text_config.pad_token_id or 0
    res = {}
    for kind, batches in (
        ("padded", [collate(g, pad_token_id=pad) for g in groups]),
        ("packed", [pack(g, max_tokens=args.max_tokens, pad_token_id=pad) for g in groups]),
    ):
        hidden = hf.text_config.hidden_size
        res[kind] = run(
            module,
            batches,
            edges=edges,
            warmup=args.warmup,
            hidden=hidden,
            device=device,
            name=f"{name} {kind}",
        )
    res["speedup"] = res["packed"]["tokens_per_s"] / res["padded"]["tokens_per_s"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench_packing.json")
    ap.add_argument("--family", nargs="+", default=list(FLAVOURS), choices=list(FLAVOURS), dest="families")
    ap.add_argument("--micro-batches", type=int, default=6)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=512, help="packed row length (>= --max-len)")
    ap.add_argument("--min-len", type=int, default=48)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--median", type=int, default=128)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--image-tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="4 micro-batches, 1 warm-up (smoke)")
    args = ap.parse_args()
    if args.quick:
        args.micro_batches, args.warmup = 4, 1

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = args.micro_batches * args.micro_batch_size
    lengths = length_mix(n, lo=args.min_len, hi=args.max_len, median=args.median, sigma=args.sigma, seed=0)
    results = {name: bench_family(name, args, device) for name in args.families}
    print(f"length mix: {n} samples, mean {sum(lengths) / n:.0f}, max {max(lengths)} tokens; device {device}")
    print(f"{'family':13} {'':7} {'tokens/s':>10} {'padding':>8} {'rows':>5} {'seconds':>8}  packed/padded")
    for name, res in results.items():
        for kind in ("padded", "packed"):
            r = res[kind]
            ratio = f"  {res['speedup']:.2f}x" if kind == "packed" else ""
            print(
                f"{name:13} {kind:7} {r['tokens_per_s']:10.0f} {r['padding_fraction']:8.1%} {r['rows']:5d} "
                f"{r['seconds']:8.2f}{ratio}"
            )
    out = {
        "config": {**vars(args), "device": str(device), "lengths_mean": sum(lengths) / n},
        "families": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
