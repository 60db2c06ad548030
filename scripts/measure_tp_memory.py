"""Measure per-rank model-state bytes (params + grads + AdamW states) of the LLM at TP=1, 2, 4 on gloo.

Counts live tensor storage (``dhp.parallel.state.model_state_bytes``: local DTensor shards, not RSS)
after one forward/backward/AdamW step of the real ``dhp.models`` LLM module. Checks that at TP=N the
largest rank holds <= 1.10 x (TP=1) / N. Prints a table and writes JSON.

    .venv/bin/python scripts/measure_tp_memory.py --out runs/tp_memory.json [--hidden 256 --layers 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BOUND = 1.10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(hidden: int, layers: int, inter: int):
    from dhp.models import get_family

    family = get_family("qwen2_5_vl")
    model_cfg = family.tiny_model_config()
    half = hidden // model_cfg.llm.num_heads // 2  # M-RoPE sections (t, h, w) must sum to head_dim / 2
    section = [half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8]
    llm = dataclasses.replace(
        model_cfg.llm,
        hidden_size=hidden,
        num_layers=layers,
        intermediate_size=inter,
        extra={**model_cfg.llm.extra, "mrope_section": section},
    )
    model_cfg = dataclasses.replace(model_cfg, llm=llm)
    hf = family.hf_config(model_cfg)
    torch.manual_seed(0)
    return family.build_module("llm", hf, device="cpu", dtype=torch.float32), hf


def _text_batch(hf, seq: int = 32) -> dict:
    g = torch.Generator().manual_seed(1)
    vocab = hf.text_config.vocab_size
    ids = torch.randint(20, vocab, (2, seq), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": ids.clone(),
        "mm_token_type_ids": torch.zeros_like(ids),
    }


def _rank(rank: int, world: int, port: int, dims: tuple[int, int, int], out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from dhp.config.schema import TrainConfig
    from dhp.layout import ParallelLayout
    from dhp.parallel import build_optimizer, parallelize
    from dhp.parallel.state import model_state_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        module, hf = _build(*dims)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallel = ParallelLayout(tp=world)
        module = parallelize(
            "llm", module, mesh, layout=parallel, activation_checkpointing=False, mixed_precision="fp32"
        )
        opt = build_optimizer(module, mesh, layout=parallel, train=TrainConfig(lr=1e-4))
        module(**_text_batch(hf)).loss_sum.backward()
        opt.step()
        Path(out_dir, f"tp{world}_rank{rank}.json").write_text(json.dumps(model_state_bytes(module, opt)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(degrees: list[int], dims: tuple[int, int, int]) -> dict:
    """{"tp<N>": {"max_rank_bytes", "ranks": [...], "ratio_vs_tp1_over_n"}} plus the bound check."""
    result: dict = {"bound": BOUND, "hidden_layers_intermediate": list(dims)}
    with tempfile.TemporaryDirectory() as tmp:
        for n in degrees:
            mp.spawn(_rank, args=(n, _free_port(), dims, tmp), nprocs=n, join=True)
            ranks = [json.loads(Path(tmp, f"tp{n}_rank{r}.json").read_text()) for r in range(n)]
            result[f"tp{n}"] = {"max_rank_bytes": max(r["total"] for r in ranks), "ranks": ranks}
    base = result[f"tp{degrees[0]}"]["max_rank_bytes"] * degrees[0]
    for n in degrees:
        entry = result[f"tp{n}"]
        entry["ratio_vs_tp1_over_n"] = entry["max_rank_bytes"] / (base / n)
        entry["ok"] = entry["ratio_vs_tp1_over_n"] <= BOUND
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/tp_memory.json")
    ap.add_argument("--degrees", default="1,2,4")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=256)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    degrees = [int(d) for d in args.degrees.split(",")]
    res = measure(degrees, (args.hidden, args.layers, args.intermediate))
    print(f"{'tp':>4} {'max bytes/rank':>16} {'x (TP1/N)':>10}  ok")
    for n in degrees:
        e = res[f"tp{n}"]
        print(f"{n:>4} {e['max_rank_bytes']:>16,} {e['ratio_vs_tp1_over_n']:>10.4f}  {e['ok']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(res[f"tp{n}"]["ok"] for n in degrees) else 1


if __name__ == "__main__":
    sys.exit(main())
