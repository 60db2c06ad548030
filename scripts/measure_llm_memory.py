"""Measure the LLM's long-sequence memory on gloo: activations per rank under TP with/without sequence
parallelism, the chunked vs the unchunked loss peak, and the hand-off bytes per LLM rank.

1. ``tp`` / ``tp_sp``: bytes of the tensors a forward leaves alive for backward (the saved
   activations), per rank, max over ranks, for the real ``dhp.models`` LLM module parallelized by
   ``dhp.parallel.parallelize`` at TP = 1, 2, 4, with ``sequence_parallel`` off/on and FULL activation
   checkpointing (what a long-sequence run uses: the checkpointed layers' inputs dominate). Counted by
   a dispatch mode that records every storage an op creates during forward and keeps those still
   alive after it (local shards under DTensor; the loss scalar is negligible). Target: TP=4 with SP
   <= 1.15 x (TP=1) / 4.
2. ``loss``: peak bytes of one loss forward + backward at a large vocab (default 32768) in one
   process, tracked by ``torch.distributed._tools.mem_tracker.MemTracker``: ``full`` = fp32 logits of
   every token then ``F.cross_entropy`` (what the loss did before), ``chunked`` = ``dhp.ops``'
   chunked cross-entropy. Target: chunked <= full / 8.
3. ``handoff``: image-embedding bytes each LLM rank copies out of the hand-off for one micro-batch
   (max over ranks, bf16 rows), without SP (every TP rank takes every row) and with SP (a rank takes
   the rows of its sequence shard: ``dhp.parallel.sequence_shard_rows``, as the worker does).

    .venv/bin/python scripts/measure_llm_memory.py --out runs/llm_memory.json
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
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

SP_BOUND = 1.15  # TP=4+SP activations <= SP_BOUND * (TP=1) / 4
LOSS_BOUND = 1 / 8  # chunked loss peak <= LOSS_BOUND * full


class LiveStorages(TorchDispatchMode):
    """Records the storage of every tensor an op returns; ``alive_bytes()``: those not freed yet, each
    storage once, except ``exclude`` (the parameters' and inputs' storages: below autograd a view of a
    weight, e.g. ``aten.t``, does not look like a view)."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__()
        self.exclude = exclude
        self.refs: list[tuple[StorageWeakRef, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, DTensor):  # a wrapper without storage: count its local shard
                t = t._local_tensor
            if isinstance(t, torch.Tensor) and type(t) is torch.Tensor:
                st = t.untyped_storage()
                self.refs.append((StorageWeakRef(st), st.nbytes(), st.data_ptr()))
        return out

    def alive_bytes(self) -> int:
        alive = {ptr: n for ref, n, ptr in self.refs if not ref.expired() and ptr not in self.exclude}
        return sum(alive.values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(hidden: int, layers: int, inter: int, vocab: int):
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
        vocab_size=vocab,
    )
    hf = family.hf_config(dataclasses.replace(model_cfg, llm=llm))
    torch.manual_seed(0)
    return family.build_module("llm", hf, device="cpu", dtype=torch.float32), hf


def _text_batch(hf, *, batch: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(20, hf.text_config.vocab_size, (batch, seq), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": ids.clone(),
        "mm_token_type_ids": torch.zeros_like(ids),
    }


def _rank(rank: int, world: int, port: int, sp: bool, args: dict, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from dhp.layout import ParallelLayout
    from dhp.parallel import parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        module, hf = _build(args["hidden"], args["layers"], args["intermediate"], args["vocab"])
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        module = parallelize(
            "llm",
            module,
            mesh,
            layout=ParallelLayout(tp=world, sequence_parallel=sp),
            activation_checkpointing="full",
            mixed_precision="fp32",
        )
        batch = _text_batch(hf, batch=args["batch"], seq=args["seq"])
        before = [*module.parameters(), *module.buffers(), *batch.values()]
        local = [t._local_tensor if isinstance(t, DTensor) else t for t in before]
        tracker = LiveStorages({t.untyped_storage().data_ptr() for t in local})
        with tracker:
            out = module(**batch)
        saved = tracker.alive_bytes()
        out.loss_sum.backward()  # the graph really holds them: backward runs on what was kept
        Path(out_dir, f"{world}_{int(sp)}_{rank}.json").write_text(json.dumps(saved))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_activations(degrees: list[int], args: dict) -> dict:
    """{"tp": {"N": max-rank bytes}, "tp_sp": {...}}."""
    res: dict = {"tp": {}, "tp_sp": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for sp in (False, True):
            for n in degrees:
                mp.spawn(_rank, args=(n, _free_port(), sp, args, tmp), nprocs=n, join=True)
                ranks = [json.loads(Path(tmp, f"{n}_{int(sp)}_{r}.json").read_text()) for r in range(n)]
                res["tp_sp" if sp else "tp"][str(n)] = max(ranks)
    return res


def measure_loss(*, tokens: int, hidden: int, vocab: int, chunk: int) -> dict:
    """Peak bytes of one loss forward+backward: fp32 logits of every token vs the chunked op."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from dhp.ops.cross_entropy import IGNORE_INDEX, shifted_ce_sum

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=g).requires_grad_(True)
    hidden_states = torch.randn(1, tokens, hidden, generator=g).requires_grad_(True)
    labels = torch.randint(0, vocab, (1, tokens), generator=g)

    def full() -> None:
        logits = F.linear(hidden_states, weight).float()
        F.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        ).backward()

    def chunked() -> None:
        shifted_ce_sum(hidden_states, weight, labels, chunk_tokens=chunk).backward()

    peaks = {}
    for name, fn in (("full", full), ("chunked", chunked)):
        weight.grad = hidden_states.grad = None
        tracker = MemTracker()
        with tracker:
            fn()
        peaks[name] = int(
            sum(tracker.get_tracker_snapshot("peak")[d]["Total"] for d in [torch.device("cpu")])
        )
    return peaks


def measure_handoff(degrees: list[int], *, batch: int, seq: int, hidden: int, image_tokens: int) -> dict:
    """Max per-rank bytes of bf16 image-embedding rows an LLM rank copies, without and with SP."""
    from dhp.parallel import sequence_shard_rows

    image_id = 7
    ids = torch.full((batch, seq), 3)
    ids[:, 8 : 8 + image_tokens] = image_id
    rows = int((ids == image_id).sum())
    row_bytes = hidden * 2
    out: dict = {"tp": {}, "tp_sp": {}}
    for n in degrees:
        out["tp"][str(n)] = rows * row_bytes
        out["tp_sp"][str(n)] = max(
            int(sequence_shard_rows(ids, image_id, tp=n, rank=r).sum()) * row_bytes for r in range(n)
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/llm_memory.json")
    ap.add_argument("--degrees", default="1,2,4")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024, help="vocab of the activation runs")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--loss-vocab", type=int, default=32768)
    ap.add_argument("--loss-tokens", type=int, default=2048)
    ap.add_argument("--loss-hidden", type=int, default=64)
    ap.add_argument("--loss-chunk", type=int, default=256)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    degrees = [int(d) for d in a.degrees.split(",")]
    dims = {k: getattr(a, k) for k in ("hidden", "layers", "intermediate", "vocab", "batch", "seq")}
    res = measure_activations(degrees, dims)
    res["loss"] = measure_loss(
        tokens=a.loss_tokens, hidden=a.loss_hidden, vocab=a.loss_vocab, chunk=a.loss_chunk
    )
    res["handoff"] = measure_handoff(
        degrees, batch=a.batch, seq=a.seq, hidden=a.hidden, image_tokens=3 * a.seq // 4
    )
    top = max(degrees)
    res["checks"] = {
        f"tp{top}_sp_over_tp1_div_{top}": res["tp_sp"][str(top)] / (res["tp"]["1"] / top),
        "loss_chunked_over_full": res["loss"]["chunked"] / res["loss"]["full"],
    }
    res["setup"] = dims | {
        "activation_checkpointing": "full",
        "loss": {
            "tokens": a.loss_tokens,
            "hidden": a.loss_hidden,
            "vocab": a.loss_vocab,
            "chunk": a.loss_chunk,
        },
    }
    print(
        f"{'tp':>4} {'saved B/rank':>14} {'+SP saved B/rank':>17} {'hand-off B/rank':>16} {'+SP hand-off':>13}"
    )
    for n in degrees:
        k = str(n)
        print(
            f"{n:>4} {res['tp'][k]:>14,} {res['tp_sp'][k]:>17,} "
            f"{res['handoff']['tp'][k]:>16,} {res['handoff']['tp_sp'][k]:>13,}"
        )
    print(f"loss peak: full {res['loss']['full']:,} B, chunked {res['loss']['chunked']:,} B")
    sp_ratio, loss_ratio = res["checks"].values()
    ok = sp_ratio <= SP_BOUND and loss_ratio <= LOSS_BOUND
    print(
        f"TP={top}+SP / (TP=1/{top}) = {sp_ratio:.3f} (<= {SP_BOUND}); chunked / full = {loss_ratio:.3f} (<= 1/8)"
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
