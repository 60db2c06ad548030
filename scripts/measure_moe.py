"""Measure expert-parallel memory and all-to-all traffic of a tiny Qwen3-VL-MoE text model on 4 gloo ranks.

For ep = 1, 2, 4 over 4 data-parallel ranks (``dhp.parallel.ep.ep_mesh`` folds the dp axis into
edp x ep), each rank runs one real step: forward of transformers' ``Qwen3VLMoeTextModel`` + lm_head
with the load-balancing aux loss, backward, expert grads SUMMED over edp and the other grads over dp,
then ``torch.optim.AdamW.step()``. ep = 1 is the unmodified HF model (every rank holds every expert);
every gradient at ep = 2 and 4 (gathered) must equal ep = 1's within 1e-5 relative, which checks the
edp reduction (ep = 2: each expert shard is held by 2 ranks) that the 2-rank parity test cannot.

- ``expert_state_bytes[ep]``: the largest rank's live bytes of expert parameters plus their AdamW
  states (exp_avg, exp_avg_sq, step), counted from the real tensors (local DTensor shards).
  Check: ep=N <= 1.10 x (ep=1) / N.
- the expert axes beyond ep, through dhp's own appliers on the same model and ranks: ``ep2_edp2``
  (dp=4 x ep=2 with expert FSDP: the experts FSDP2-sharded over their 2 edp ranks,
  ``dhp.parallel.fsdp.apply_expert_fsdp``) and ``etp2_ep2`` (dp=2 x tp=2 x ep=2 x etp=2: the 2 TP ranks
  of a unit route half its tokens each, the experts cut over all 4 ranks). Counted after the AdamW
  step like the others. Check: each <= 1.10 x (ep=1) / 4.
- ``a2a_bytes``: at ep = 4, what every rank handed to ``all_to_all`` over the step (forward and
  backward), summed over ranks, counted by ``dhp.parallel.CommCounter`` on the dispatcher (so the
  per-expert count exchange is included), against the minimum: for each MoE layer, dispatch and
  combine each move tokens x top-k x hidden x element size, once in forward and once in backward
  (4 x tokens x top-k x hidden x bytes per layer). Check: within 5 %.

    .venv/bin/python scripts/measure_moe.py --out runs/moe.json
"""

from __future__ import annotations

import argparse
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
from torch import nn

WORLD, EPS, MEM_BOUND, A2A_BOUND = 4, (1, 2, 4), 1.10, 0.05
GRAD_RTOL = 1e-5  # fp32: EP only changes float summation order, so its gradients must equal plain DP's
SIZES = dict(vocab=512, hidden=128, moe_inter=64, layers=2, experts=8, top_k=2, seqs=2, seq=32)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model() -> nn.Module:
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextModel

    s = SIZES
    cfg = Qwen3VLMoeTextConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=2 * s["hidden"],
        moe_intermediate_size=s["moe_inter"],
        num_hidden_layers=s["layers"],
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=s["experts"],
        num_experts_per_tok=s["top_k"],
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "language_model": Qwen3VLMoeTextModel(cfg),
            "lm_head": nn.Linear(s["hidden"], s["vocab"], bias=False),
        }
    )
    return model.float()


def _is_expert(name: str) -> bool:
    return ".experts." in name


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _grad_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest relative (norm-sense) difference over every parameter's full gradient."""
    assert set(got) == set(want), set(got) ^ set(want)
    return max(float((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-12)) for n in want)


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def _step(rank: int, ep: int) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    """One training step at this ep: (this rank's expert bytes and all-to-all bytes, full reduced grads)."""
    from dhp.layout import ParallelLayout
    from dhp.parallel import CommCounter, build_mesh
    from dhp.parallel.ep import apply_ep, ep_mesh, expert_params, reduce_expert_grads_
    from dhp.parallel.load_balancing import load_balancing_loss

    s = SIZES
    layout = ParallelLayout(dp=WORLD, ep=ep)
    mesh = ep_mesh(build_mesh(layout, "cpu"), layout)
    model = _model()
    if ep > 1:
        apply_ep(model, mesh, block_glob="language_model.layers.*.mlp")
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens (data parallel)
    ids = torch.randint(0, s["vocab"], (s["seqs"], s["seq"]), generator=g)
    counter = CommCounter("llm")
    with counter:
        out = model["language_model"](input_ids=ids, output_router_logits=True)
        logits = model["lm_head"](out.last_hidden_state).float()
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, s["vocab"]), ids[:, 1:].reshape(-1), reduction="sum")
        share, _ = load_balancing_loss(
            out.router_logits, num_experts=s["experts"], top_k=s["top_k"], group=dist.group.WORLD
        )
        (ce / (WORLD * ids[:, 1:].numel()) + 0.001 * share).backward()
    a2a = counter.step().get("llm/all_to_all")
    experts = [p for _, p in expert_params(model)]
    reduce_expert_grads_(experts, mesh)
    for name, p in model.named_parameters():
        if not (ep > 1 and _is_expert(name)):  # at ep=1 the experts are plain replicated DP parameters
            dist.all_reduce(p.grad)
    grads = {
        n: (p.grad.full_tensor() if _is_dtensor(p.grad) else p.grad).clone()
        for n, p in model.named_parameters()
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    expert_tensors = [p for n, p in model.named_parameters() if _is_expert(n)]
    param_bytes = sum(_local_bytes(p) for p in expert_tensors)
    opt_bytes = sum(
        _local_bytes(v) for p in expert_tensors for v in opt.state[p].values() if isinstance(v, torch.Tensor)
    )
    tokens = ids.numel()
    return {
        "expert_param_bytes": param_bytes,
        "expert_optimizer_bytes": opt_bytes,
        "a2a_payload_bytes": 0 if a2a is None else a2a.payload_bytes,
        "a2a_wire_bytes": 0 if a2a is None else int(a2a.wire_bytes),
        "a2a_minimum_bytes": 4 * s["layers"] * tokens * s["top_k"] * s["hidden"] * 4 if ep > 1 else 0,
    }, grads


#: the expert axes measured beyond ep: name -> (layout keywords, parts the experts are cut into)
AXES = {
    "ep2_edp2": ({"dp": 4, "ep": 2, "expert_fsdp": True}, 4),
    "etp2_ep2": ({"dp": 2, "tp": 2, "ep": 2, "etp": 2}, 4),
}


def _axes_step(rank: int, name: str) -> dict[str, int]:
    """One step at an expert-axes layout of :data:`AXES`: this rank's expert param and AdamW bytes."""
    from dhp.layout import ParallelLayout
    from dhp.parallel import build_mesh
    from dhp.parallel.ep import apply_ep, ep_mesh
    from dhp.parallel.fsdp import apply_expert_fsdp
    from dhp.parallel.meshutil import axis

    s = SIZES
    layout = ParallelLayout(**AXES[name][0])
    module_mesh = build_mesh(layout, "cpu")
    model = _model()
    tp = axis(module_mesh, "tp") if layout.etp > 1 else None
    apply_ep(model, ep_mesh(module_mesh, layout), block_glob="language_model.layers.*.mlp",
             tp_group=None if tp is None else tp.get_group())  # fmt: skip
    if layout.expert_fsdp:
        apply_expert_fsdp(model, "fp32")
    g = torch.Generator().manual_seed(100 + layout.unit_of(rank))  # a unit's TP ranks: the same tokens
    ids = torch.randint(0, s["vocab"], (s["seqs"], s["seq"]), generator=g)
    out = model["language_model"](input_ids=ids)
    logits = model["lm_head"](out.last_hidden_state).float()
    F.cross_entropy(logits[:, :-1].reshape(-1, s["vocab"]), ids[:, 1:].reshape(-1)).backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    experts = [p for n, p in model.named_parameters() if _is_expert(n)]
    states = [v for p in experts for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return {
        "expert_param_bytes": sum(_local_bytes(p) for p in experts),
        "expert_optimizer_bytes": sum(_local_bytes(v) for v in states),
    }


def _rank(rank: int, port: int, out_path: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results, ref = {}, {}
        for ep in EPS:
            mine, grads = _step(rank, ep)
            ref = ref or grads  # ep=1 (plain DP) is the reference every EP degree must reproduce
            mine["grad_rel_error_vs_ep1"] = _grad_error(grads, ref)
            gathered: list[dict[str, int]] = [{}] * WORLD
            dist.all_gather_object(gathered, mine)
            results[ep] = gathered
        for name in AXES:
            gathered = [{}] * WORLD
            dist.all_gather_object(gathered, _axes_step(rank, name))
            results[name] = gathered
        if rank == 0:
            Path(out_path).write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = os.path.join(tmp, "raw.json")
        mp.start_processes(_rank, args=(_free_port(), raw_path), nprocs=WORLD, join=True, start_method="fork")
        raw = {int(k) if k.isdigit() else k: v for k, v in json.loads(Path(raw_path).read_text()).items()}

    grad_err = max(r["grad_rel_error_vs_ep1"] for ep in EPS for r in raw[ep])
    state = {
        k: max(r["expert_param_bytes"] + r["expert_optimizer_bytes"] for r in raw[k]) for k in (*EPS, *AXES)
    }
    top = max(EPS)
    measured = sum(r["a2a_payload_bytes"] for r in raw[top])
    minimum = sum(r["a2a_minimum_bytes"] for r in raw[top])
    report = {
        "expert_state_bytes": {"ep1": state[1]} | {str(k): state[k] for k in (*EPS, *AXES)},
        "a2a_bytes": {"measured": measured, "minimum": minimum},
        "detail": {
            "world": WORLD,
            "a2a_ep": top,
            "grad_rel_error_vs_ep1": grad_err,
            "a2a_wire_bytes": sum(r["a2a_wire_bytes"] for r in raw[top]),
            "sizes": SIZES,
            "per_rank": {str(k): raw[k] for k in (*EPS, *AXES)},
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))

    ok = True
    print(f"expert params + AdamW state per rank ({WORLD} ranks, largest rank):")
    for ep in EPS:
        bound = MEM_BOUND * state[1] / ep
        good = state[ep] <= bound
        ok &= good
        print(f"  ep={ep}: {state[ep]:>10,d} B   bound {bound:>12,.0f} B   {'ok' if good else 'OVER'}")
    for name, (_, parts) in AXES.items():
        bound = MEM_BOUND * state[1] / parts
        good = state[name] <= bound
        ok &= good
        print(f"  {name}: {state[name]:>10,d} B   bound {bound:>12,.0f} B   {'ok' if good else 'OVER'}"
              f"   ({state[name] / state[1]:.4f} of ep=1)")  # fmt: skip
    off = abs(measured - minimum) / minimum
    ok &= off <= A2A_BOUND
    print(
        f"all-to-all bytes per step at ep={top} (all ranks, fwd + bwd): measured {measured:,d} B, "
        f"minimum {minimum:,d} B, off by {100 * off:.2f} % (bound {100 * A2A_BOUND:.0f} %)"
    )
    ok &= grad_err <= GRAD_RTOL
    print(
        f"every gradient at ep=2, 4 vs ep=1 (plain DP): max relative error {grad_err:.1e} (bound {GRAD_RTOL:.0e})"
    )
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
