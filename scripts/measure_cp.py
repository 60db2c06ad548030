"""Measure the LLM's activation memory per rank under context parallelism on gloo, against the planner.

For cp = 1, 2, 4 (on as many gloo ranks), the real ``dhp.models`` LLM module (Qwen2.5-VL's decoder,
widened) parallelized by ``dhp.parallel.parallelize`` with ``cp`` runs one forward of a text batch;
counted are the bytes of the tensors the forward leaves alive for backward (the saved activations),
per rank, max over ranks, by the dispatch mode of ``scripts/measure_llm_memory.py`` (every storage an
op creates during forward and still alive after it; parameters and inputs excluded). The planner's
prediction is the plan's ``activations`` of the same module, sequence and degrees
(``dhp.plan.memory.activations_of`` through ``dhp.plan.compile.module_shapes``).

Target: cp=N <= 1.15 x (cp=1) / N, and the plan within +-10 % of the measurement.

    .venv/bin/python scripts/measure_cp.py --out runs/cp_memory.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from measure_llm_memory import LiveStorages, _build, _free_port, _text_batch
from torch.distributed.tensor import DTensor

CP_BOUND = 1.15  # cp=N activations <= CP_BOUND * (cp=1) / N
PLAN_BOUND = 0.10  # |predicted / measured - 1| <= PLAN_BOUND


def _rank(rank: int, world: int, port: int, args: dict, out_dir: str) -> None:
    from dhp.layout import ParallelLayout
    from dhp.parallel import build_mesh, parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        module, hf = _build(args["hidden"], args["layers"], args["intermediate"], args["vocab"])
        layout = ParallelLayout(cp=world)
        module = parallelize(
            "llm", module, build_mesh(layout, "cpu"), layout, activation_checkpointing=args["ac"],
            mixed_precision="fp32", loss_chunk_tokens=args["chunk"],
        )  # fmt: skip
        batch = _text_batch(hf, batch=args["batch"], seq=args["seq"])
        before = [*module.parameters(), *module.buffers(), *batch.values()]
        local = [t._local_tensor if isinstance(t, DTensor) else t for t in before]
        tracker = LiveStorages({t.untyped_storage().data_ptr() for t in local})
        with tracker:
            out = module(**batch)
        saved = tracker.alive_bytes()
        out.loss_sum.backward()  # the graph really holds them: backward runs on what was kept
        Path(out_dir, f"{world}_{rank}.json").write_text(json.dumps(saved))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def predicted(cp: int, args: dict) -> int:
    """The plan's saved activations of one LLM rank at this cp (the same module, sequence and AC)."""
    from dhp.plan.compile import module_shapes
    from dhp.plan.memory import activations_of
    from dhp.validation import load_config

    over = [
        "model.dtype=float32", "modules.llm.mixed_precision=fp32", f"modules.llm.gpus={cp}",
        "modules.llm.parallel.tp=1", f"modules.llm.parallel.cp={cp}",
        f"modules.llm.activation_checkpointing={args['ac']}", f"modules.llm.seq_len={args['seq']}",
        f"modules.llm.loss_chunk_tokens={args['chunk']}", "placement=disaggregated", "modules.vision.gpus=1",
        "modules.vision.parallel.sp=1", f"train.micro_batch_size={args['batch']}",
        f"train.global_batch_size={args['batch']}", f"model.llm.hidden_size={args['hidden']}",
        f"model.llm.num_layers={args['layers']}", f"model.llm.intermediate_size={args['intermediate']}",
        f"model.llm.vocab_size={args['vocab']}", "cluster.gpus_per_node=8",
    ]  # fmt: skip
    module, _ = _build(args["hidden"], args["layers"], args["intermediate"], args["vocab"])
    section = module.language_model.config.rope_parameters["mrope_section"]
    over.append(f"model.llm.extra.mrope_section=[{','.join(str(x) for x in section)}]")
    cfg = load_config("tiny_vlm", over)
    shape = module_shapes(cfg)["llm"]
    return int(sum(activations_of(shape).values()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/cp_memory.json"))
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256, help="loss chunk tokens")
    ap.add_argument(
        "--ac", default="off", help="activation checkpointing of the LLM (off | full | selective)"
    )
    ap.add_argument("--degrees", default="1,2,4")
    a = ap.parse_args()
    args = {
        k: getattr(a, k) for k in ("seq", "batch", "hidden", "layers", "intermediate", "vocab", "chunk", "ac")
    }
    out: dict = {"llm_activation_peak_bytes": {}, "args": args}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in a.degrees.split(",")):
            mp.spawn(_rank, args=(n, _free_port(), args, tmp), nprocs=n, join=True)
            measured = max(json.loads(Path(tmp, f"{n}_{r}.json").read_text()) for r in range(n))
            out["llm_activation_peak_bytes"][str(n)] = {"measured": measured, "predicted": predicted(n, args)}
    peaks = out["llm_activation_peak_bytes"]
    base = peaks["1"]["measured"] if "1" in peaks else None
    ok = True
    for n, row in peaks.items():
        ratio = row["predicted"] / row["measured"]
        line = f"cp={n}: measured {row['measured'] / 2**20:.2f} MiB, planned {row['predicted'] / 2**20:.2f} MiB ({ratio:.3f}x)"
        if base is not None and n != "1":
            bound = CP_BOUND * base / int(n)
            line += f"; bound {CP_BOUND} x cp1 / {n} = {bound / 2**20:.2f} MiB {'ok' if row['measured'] <= bound else 'OVER'}"
            ok &= row["measured"] <= bound
        ok &= abs(ratio - 1) <= PLAN_BOUND
        print(line)
    out["ok"] = ok
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}; {'all within bounds' if ok else 'SOME OUT OF BOUNDS'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
