"""Per-rank model-state bytes of the vision encoder under encoder TP=N, against (TP=1)/N.

Builds the encoder on the ``meta`` device (no memory), applies :func:`dhp.parallel.llm_tp.apply_tp` (the family's encoder plan)
on real gloo ranks, and sums the bytes of each rank's local parameter shards (DTensor ``to_local()``,
replicated tensors in full). Gradients and Adam states follow the parameters' placement, so the ratio
holds for all model states. Default architecture: the Qwen2.5-VL-32B encoder (hidden 1280, 32 blocks,
MLP width 3420, uneven at TP=8, merger to 5120), bf16.

    .venv/bin/python scripts/measure_vision_tp_params.py --tp 1 2 4 8

Target: per-rank bytes at TP=N <= 1.10 x (TP=1 bytes) / N.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from dhp.config.schema import VisionArch
from dhp.models import get_family
from dhp.parallel.llm_tp import apply_tp as apply_vision_tp


def _rank(rank: int, world: int, port: int, out_hidden: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        family = get_family("qwen2_5_vl")
        tiny = family.tiny_model_config()
        cfg = dataclasses.replace(
            tiny,
            vision=VisionArch(),
            llm=dataclasses.replace(tiny.llm, hidden_size=out_hidden),
        )
        module = family.build_module("vision", family.hf_config(cfg), device="meta", dtype=torch.bfloat16)
        full = sum(p.numel() * p.element_size() for p in module.parameters())
        if world > 1:
            apply_vision_tp(
                module, dist.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
            )
        local = sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
            for p in module.parameters()
        )
        Path(tmp, f"{rank}.json").write_text(json.dumps({"full": full, "local": local}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--out-hidden", type=int, default=5120, help="merger output width (the LLM's hidden)")
    args = parser.parse_args()
    for n in args.tp:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank, args=(n, _free_port(), args.out_hidden, tmp), nprocs=n, join=True)
            ranks = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(n)]
        full, worst = ranks[0]["full"], max(r["local"] for r in ranks)
        print(
            f"TP={n}: full {full / 2**20:.1f} MiB, max per-rank {worst / 2**20:.1f} MiB, "
            f"ratio to (TP=1)/N {worst / (full / n):.4f} (target <= 1.10)"
        )


if __name__ == "__main__":
    main()
