"""Measure the vision encoder's activation bytes per rank under Ulysses SP=N against SP=1.

Activation bytes = the unique storages the autograd graph saves for backward during one forward
(``torch.autograd.graph.saved_tensors_hooks``), excluding parameter storages: what a rank holds between
its forward and its backward. Not RSS. Runs real gloo ranks on CPU (the same code path as NCCL).

    .venv/bin/python scripts/measure_sp_memory.py --sp 1 2 4 --out runs/sp_memory.json

Target: max over ranks at SP=N <= 1.15 x (SP=1 bytes) / N on an image long enough to matter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dhp.config.schema import VisionArch
from dhp.models import get_family
from dhp.models.qwen2_5_vl.sp_shard import shard_vision_batch
from dhp.parallel.ulysses import UlyssesSpec, apply_ulysses_sp


def _arch(args: argparse.Namespace) -> VisionArch:
    return VisionArch(
        depth=args.depth,
        hidden_size=args.hidden,
        num_heads=args.heads,
        intermediate_size=args.intermediate,
        extra={"window_size": 112, "fullatt_block_indexes": list(args.fullatt)},
    )


def _build(arch: VisionArch) -> torch.nn.Module:
    family = get_family("qwen2_5_vl")
    model_cfg = dataclasses.replace(family.tiny_model_config(), vision=arch)
    torch.manual_seed(0)
    return family.build_module("vision", family.hf_config(model_cfg), device="cpu", dtype=torch.float32)


def _saved_activation_bytes(module: torch.nn.Module, shard) -> tuple[int, torch.Tensor]:
    """Sum of unique non-parameter storages saved for backward by one forward; returns (bytes, output)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in param_ptrs:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(**shard.forward_kwargs())["image_embeds"]
    return sum(storages.values()), out


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        arch = _arch(args)
        module = _build(arch)
        if world > 1:
            mesh = dist.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
            apply_ulysses_sp(module, mesh, UlyssesSpec())
        thw = torch.tensor([args.grid], dtype=torch.long)
        row = arch.in_channels * arch.temporal_patch_size * arch.patch_size**2
        pixels = torch.randn(int(thw.prod()), row, generator=torch.Generator().manual_seed(1))
        hf_vision = (
            get_family("qwen2_5_vl")
            .hf_config(dataclasses.replace(get_family("qwen2_5_vl").tiny_model_config(), vision=arch))
            .vision_config
        )
        shard = shard_vision_batch(pixels, thw, sp_size=world, arch=hf_vision)[rank]
        nbytes, out = _saved_activation_bytes(module, shard)
        out.sum().backward()  # every rank joins the backward all-to-alls
        Path(tmp, f"{rank}.json").write_text(json.dumps({"bytes": nbytes, "patches": shard.num_patches}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args: argparse.Namespace, world: int) -> list[dict]:
    """Per-rank {bytes, patches} at SP=world."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(world, _free_port(), args, tmp), nprocs=world, join=True)
        return [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--grid", type=int, nargs=3, default=[1, 96, 96], help="image (t, h, w) in patches")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--fullatt", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--out", type=Path, default=Path("runs/sp_memory.json"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sizes = sorted(set(args.sp) | {1})
    results = {n: measure(args, n) for n in sizes}
    base = results[1][0]["bytes"]
    report = {"arch": dataclasses.asdict(_arch(args)), "grid_thw": args.grid, "target_ratio": 1.15, "sp": {}}
    print(
        f"image grid {args.grid} = {results[1][0]['patches']} patches; SP=1 activations {base / 2**20:.2f} MiB"
    )
    for n, ranks in results.items():
        worst = max(r["bytes"] for r in ranks)
        ratio = worst / (base / n)
        report["sp"][str(n)] = {"per_rank": ranks, "max_rank_bytes": worst, "ratio_to_ideal": ratio}
        per_rank = ", ".join(f"{r['bytes'] / 2**20:.2f}" for r in ranks)
        print(f"SP={n}: per-rank MiB [{per_rank}]  max/(SP1/N) = {ratio:.3f}  (target <= 1.15)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
