"""Measure pipeline parallelism on gloo against the planner: per-stage memory, the schedules' step time,
and the experts' state under expert FSDP.

The real ``dhp.models`` LLM module (Qwen2.5-VL's decoder, widened), cut into stages by
``dhp.parallel.parallelize`` (``parallel.pp``) and run by ``dhp.parallel.pipeline.run_pipeline``, the
runtime's own schedule call, on text micro-batches.

- ``stage_peak_bytes`` (4 gloo ranks, pp = 4, 1F1B, 8 micro-batches): per pipeline rank, its model
  states (parameters, gradients and AdamW states: the real tensors' bytes after a step) plus the peak
  of its live activation storages during the schedule (every storage an op created and still alive,
  sampled at the end of each stage forward; parameters, inputs and gradients excluded), against the
  plan's same terms for the same module, degrees and micro-batches
  (``dhp.plan.pipeline.pipeline_terms``: params + grads + optimizer + saved activations x the
  schedule's micro-batches in flight + torch's receive buffers). Target: within +-10 %.
- ``step_s`` (2 gloo ranks, pp = 2: the box's 2 cores give each rank one, so the stages run in
  parallel as on GPUs): 1F1B and interleaved 1F1B (2 stages per rank) at 4 and 8 micro-batches,
  the median of 3 steps, against the planner's bubble model: each rank's compute of its stages' M
  micro-batches, measured alone (the same forward and backward, no pipeline), times ``1 +
  bubble_fraction`` of the slowest rank (``dhp.plan.pipeline.bubble_fraction``, equal to the simulated
  makespan of torch's own order: ``dhp.plan.pipeline_sim``), plus the plan's point-to-point term at
  this box's measured gloo message time. Target: within +-15 %.
- ``expert_state_bytes``: ``scripts/measure_moe.py``'s (4 gloo ranks): the largest rank's expert
  parameters and AdamW states at ep = 1 and at ep = 2 x edp = 2 under expert FSDP. Target: the latter
  <= 1.1 x (ep=1) / 4.

    .venv/bin/python scripts/measure_pp.py --out runs/pp.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from measure_llm_memory import LiveStorages, _build, _free_port, _text_batch
from torch.distributed.tensor import DTensor

MEM_BOUND, TIME_BOUND, EXPERT_BOUND = 0.10, 0.15, 1.10
SIZES = dict(hidden=256, layers=8, intermediate=512, vocab=1024, seq=256, batch=1)
MEM_MICRO_BATCHES = 8
TIME_CASES = [("1f1b", 1, 4), ("1f1b", 1, 8), ("interleaved_1f1b", 2, 4), ("interleaved_1f1b", 2, 8)]


def _local_bytes(t: torch.Tensor) -> int:
    t = t._local_tensor if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def _micro_batches(hf, n: int) -> list:
    from dhp.parallel.pipeline import MicroBatch

    out = []
    for i in range(n):
        b = _text_batch(hf, batch=SIZES["batch"], seq=SIZES["seq"])
        g = torch.Generator().manual_seed(10 + i)
        b["input_ids"] = torch.randint(20, hf.text_config.vocab_size, b["input_ids"].shape, generator=g)
        b["labels"] = b["input_ids"].clone()
        out.append(MicroBatch(inputs=b, shape=tuple(b["input_ids"].shape)))
    return out


def _parallel(layout):
    from dhp.parallel import build_mesh, parallelize

    module, hf = _build(SIZES["hidden"], SIZES["layers"], SIZES["intermediate"], SIZES["vocab"])
    mesh = build_mesh(layout, "cpu")
    module = parallelize("llm", module, mesh, layout, activation_checkpointing="off", mixed_precision="fp32")
    return module, hf, mesh


def _run(module, mesh, layout, micro, hf) -> None:
    from dhp.parallel.pipeline import run_pipeline

    tokens = sum(int((m.inputs["labels"][:, 1:] != -100).sum()) for m in micro)
    run_pipeline(module, mesh, layout, micro, rank=dist.get_rank(), hidden=hf.text_config.hidden_size,
                 dtype=torch.float32, num_label_tokens=tokens, device=torch.device("cpu"))  # fmt: skip


def _memory_rank(rank: int) -> dict[str, int]:
    """One 1F1B step at pp = world: this rank's states and its peak of live activations."""
    from dhp.config.schema import TrainConfig
    from dhp.layout import ParallelLayout
    from dhp.parallel import build_optimizer

    layout = ParallelLayout(pp=dist.get_world_size())
    module, hf, mesh = _parallel(layout)
    micro = _micro_batches(hf, MEM_MICRO_BATCHES)
    before = [*module.parameters(), *module.buffers(), *(t for m in micro for t in m.inputs.values())]
    tracker = LiveStorages({_local(t).untyped_storage().data_ptr() for t in before})
    peaks: list[int] = []

    def sample(*_: object) -> None:  # the end of a stage forward: what its micro-batches keep
        grads = {
            _local(p.grad).untyped_storage().data_ptr() for p in module.parameters() if p.grad is not None
        }
        alive = {ptr: n for ref, n, ptr in tracker.refs if not ref.expired() and ptr not in tracker.exclude}
        peaks.append(sum(n for ptr, n in alive.items() if ptr not in grads))

    hook = module.register_forward_hook(sample)
    with tracker:
        _run(module, mesh, layout, micro, hf)
    hook.remove()
    opt = build_optimizer(module, mesh, layout=layout, train=TrainConfig(lr=1e-3))
    opt.step()
    states = sum(
        _local_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    return {
        "params": sum(_local_bytes(p) for p in module.parameters()),
        "grads": sum(_local_bytes(p.grad) for p in module.parameters() if p.grad is not None),
        "optimizer": states,
        "activations": max(peaks),
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _compute_alone(module, layout, micro, hf) -> float:
    """Seconds of this rank's stages' forward and backward of every micro-batch, without the pipeline
    (random input rows and output gradients in place of the neighbours')."""
    from dhp.parallel.pipeline import _Stage

    rows = max(b * s for b, s in (m.shape for m in micro))
    h = hf.text_config.hidden_size
    t0 = time.perf_counter()
    for st, lo, hi in module.pipeline_stages:
        first, last = st == 0, st == layout.num_stages - 1
        stage = _Stage(
            module, lo, hi, first=first, last=last, micro_batches=micro, rows=rows, num_label_tokens=1
        )
        for i in range(len(micro)):
            x = torch.empty(1, 0) if first else torch.randn(rows, h, requires_grad=True)
            out = stage(x, torch.tensor(i))
            out.backward() if last else out.backward(torch.randn_like(out))
    module.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _message_s(rank: int) -> float:
    """One hidden-state message between the two ranks (half a gloo send/recv round trip, median of 3
    runs of 20): the link the planner's point-to-point term is charged at, calibrated on this box."""
    x = torch.zeros(SIZES["batch"] * SIZES["seq"], SIZES["hidden"])
    runs = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(20):
            if rank == 0:
                dist.send(x, dst=1)
                dist.recv(x, src=1)
            else:
                dist.recv(x, src=0)
                dist.send(x, dst=0)
        runs.append((time.perf_counter() - t0) / 40)
    return statistics.median(runs)


def _time_rank(rank: int) -> list[dict]:
    from dhp.layout import ParallelLayout

    message_s = _message_s(rank)
    out = []
    for schedule, virtual, m in TIME_CASES:
        layout = ParallelLayout(pp=dist.get_world_size(), pp_virtual=virtual, pp_schedule=schedule)
        module, hf, mesh = _parallel(layout)
        micro = _micro_batches(hf, m)
        _run(module, mesh, layout, micro, hf)  # warm-up
        alone, steps = [], []
        for _ in range(3):
            dist.barrier()
            alone.append(_compute_alone(module, layout, micro, hf))
            dist.barrier()
            t0 = time.perf_counter()
            _run(module, mesh, layout, micro, hf)
            dist.barrier()
            steps.append(time.perf_counter() - t0)
            module.zero_grad(set_to_none=True)
        out.append({"schedule": schedule, "virtual": virtual, "microbatches": m, "message_s": message_s,
                    "alone_s": statistics.median(alone), "step_s": statistics.median(steps)})  # fmt: skip
    return out


def _rank(rank: int, world: int, port: int, what: str, out_path: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mine = _memory_rank(rank) if what == "memory" else _time_rank(rank)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            Path(out_path).write_text(json.dumps(gathered))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(world: int, what: str) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "raw.json")
        mp.start_processes(_rank, args=(world, _free_port(), what, path), nprocs=world, join=True,
                           start_method="fork")  # fmt: skip
        return json.loads(Path(path).read_text())


def _shape(pp: int, micro_batches: int, **parallel: object):
    """The plan's LLM shape for the measured module, degrees and micro-batches."""
    from dhp.plan.compile import module_shapes
    from dhp.validation import load_config

    module, _ = _build(SIZES["hidden"], SIZES["layers"], SIZES["intermediate"], SIZES["vocab"])
    section = module.language_model.config.rope_parameters["mrope_section"]
    over = [
        "model.dtype=float32", "modules.llm.mixed_precision=fp32", f"modules.llm.gpus={pp}",
        "modules.llm.parallel.tp=1", "modules.llm.parallel.sequence_parallel=false", f"modules.llm.parallel.pp={pp}",
        *(f"modules.llm.parallel.{k}={v}" for k, v in parallel.items()),
        "modules.llm.activation_checkpointing=off", f"modules.llm.seq_len={SIZES['seq']}",
        "placement=disaggregated", "modules.vision.gpus=1", "modules.vision.parallel.sp=1",
        f"train.micro_batch_size={SIZES['batch']}", f"train.global_batch_size={SIZES['batch'] * micro_batches}",
        f"model.llm.hidden_size={SIZES['hidden']}", f"model.llm.num_layers={SIZES['layers']}",
        f"model.llm.intermediate_size={SIZES['intermediate']}", f"model.llm.vocab_size={SIZES['vocab']}",
        f"model.llm.extra.mrope_section=[{','.join(str(x) for x in section)}]", "cluster.gpus_per_node=8",
    ]  # fmt: skip
    cfg = load_config("tiny_vlm", over)
    return module_shapes(cfg)["llm"], cfg


def predicted_stage_bytes(pp: int, micro_batches: int) -> list[dict[str, int]]:
    """Per pipeline rank, the plan's states and in-flight activations (module docstring)."""
    from dhp.plan.pipeline import pipeline_terms

    shape, cfg = _shape(pp, micro_batches)
    terms = pipeline_terms(shape, micro_batches=micro_batches, optimizer_impl=cfg.train.optimizer.impl)
    out = []
    for t in terms:
        acts = int(t.saved_total * t.in_flight) + t.fwd_work.get("p2p_buffers", 0)
        out.append({"params": t.params, "grads": t.grads, "optimizer": t.optimizer, "activations": acts})
    return out


def predicted_step_s(schedule: str, virtual: int, m: int, alone: list[float], message_s: float) -> float:
    """The planner's model: the slowest rank's compute alone x (1 + bubble_fraction), plus its
    point-to-point term (``p2p_seconds``: a message before each stage forward and backward and the
    fill and drain, ``2 (v M + pp - 1)`` messages) at this box's measured message time."""
    from dhp.layout import ParallelLayout
    from dhp.plan.pipeline import bubble_fraction

    pp = len(alone)
    layout = ParallelLayout(pp=pp, pp_virtual=virtual, pp_schedule=schedule)
    p2p = 2.0 * message_s * (m * virtual + pp - 1)
    return max(alone) * (1.0 + bubble_fraction(layout, micro_batches=m)) + p2p


def _experts() -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "moe.json")
        script = Path(__file__).with_name("measure_moe.py")
        subprocess.run([sys.executable, str(script), "--out", str(out)], check=False, capture_output=True)
        state = json.loads(out.read_text())["expert_state_bytes"]
    return {"ep1": int(state["ep1"]), "ep2_edp2": int(state["ep2_edp2"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    ok = True

    measured = _spawn(4, "memory")
    predicted = predicted_stage_bytes(4, MEM_MICRO_BATCHES)
    stages = []
    print(f"per-stage peak (states + activations in flight), pp=4 1f1b, {MEM_MICRO_BATCHES} micro-batches:")
    for r, (got, want) in enumerate(zip(measured, predicted, strict=True)):
        g, w = sum(got.values()), sum(want.values())
        good = abs(w / g - 1) <= MEM_BOUND
        ok &= good
        stages.append(
            {"stage": r, "measured": g, "predicted": w, "measured_terms": got, "predicted_terms": want}
        )
        print(
            f"  stage {r}: measured {g:>12,d} B  predicted {w:>12,d} B  ({w / g - 1:+.1%})  {'ok' if good else 'OFF'}"
        )

    timed = _spawn(2, "time")
    steps = []
    print("step time, pp=2 (measured median of 3 vs the bubble model on each rank's compute alone):")
    for i, (schedule, virtual, m) in enumerate(TIME_CASES):
        rows = [per_rank[i] for per_rank in timed]
        got = max(r["step_s"] for r in rows)
        want = predicted_step_s(schedule, virtual, m, [r["alone_s"] for r in rows], rows[0]["message_s"])
        good = abs(want / got - 1) <= TIME_BOUND
        ok &= good
        steps.append({"schedule": schedule if virtual == 1 else "interleaved", "microbatches": m,
                      "measured": got, "predicted": want, "alone_s": [r["alone_s"] for r in rows],
                      "message_s": rows[0]["message_s"]})  # fmt: skip
        print(f"  {schedule:<17} M={m}: measured {got:.3f} s  predicted {want:.3f} s  ({want / got - 1:+.1%})  "
              f"{'ok' if good else 'OFF'}")  # fmt: skip

    experts = _experts()
    bound = EXPERT_BOUND * experts["ep1"] / 4
    good = experts["ep2_edp2"] <= bound
    ok &= good
    print(f"expert state per rank: ep1 {experts['ep1']:,d} B, ep2 x edp2 (expert FSDP) {experts['ep2_edp2']:,d} B "
          f"(bound {bound:,.0f} B)  {'ok' if good else 'OVER'}")  # fmt: skip

    report = {"stage_peak_bytes": stages, "step_s": steps, "expert_state_bytes": experts, "sizes": SIZES}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}: {'all within target' if ok else 'SOME OFF TARGET'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
