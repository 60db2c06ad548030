"""``bf16_master_fp32`` observed directly on the runtime's own workers: fp32 master weights, gradients
and AdamW states, bf16 compute and bf16 hand-off rows (a precision that silently did nothing would
leave the numbers close, so the dtypes are looked at, not inferred from a tolerance).

Two gloo ranks each build :class:`dhp.runtime.loop.worker.ModuleWorker` for both modules of ``tiny_vlm``
(vision Ulysses SP=2, LLM TP=2 with sequence parallelism: fsdp=1, the unit cast) from a config with
``model.dtype=bfloat16`` (weights drawn in bf16, as a bf16 checkpoint holds them) and
``mixed_precision=bf16_master_fp32``, then run one step by hand through the workers' own pieces:
``build`` (parameters stored fp32: the upcast), ``produce`` (the channel's payload: bf16 bits),
``_assemble`` (the LLM's leaf: bf16), the LLM forward and backward, the encoder's backward,
``finalize_grads`` and ``optimizer_step``. Observed: every Linear of both modules sees a bf16 weight
and bf16 input and gives a bf16 output in forward; the tensors autograd saves are mostly bf16; the
loss is fp32; every parameter and gradient is fp32, every AdamW state fp32 (8 bytes per local
parameter element), and the parameters stay fp32 after the update. ``mixed_precision=bf16`` on the
same workers stores everything in bf16 (2 + 2 + 4 bytes per element; slow tier).
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
from parallel_harness import spawn
from torch import nn

from dhp.data.batch import VLBatch
from dhp.models import get_family
from dhp.models.testing import tiny_vl_batch
from dhp.plan import compile_plan
from dhp.runtime.actors.spec import WorkerSpec, without_degrees
from dhp.runtime.handoff.graph import links_of
from dhp.runtime.handoff.routing import ProducerWork, Route
from dhp.runtime.handoff.transport import Bf16Bits
from dhp.runtime.loop.worker import ModuleWorker
from dhp.validation import load_config

pytestmark = pytest.mark.parity


def _workers(rank: int, world: int, policy: str) -> tuple[dict[str, ModuleWorker], object]:
    config = load_config("tiny_vlm", ["model.dtype=bfloat16", *(f"modules.{m}.mixed_precision={policy}"
                                                               for m in ("vision", "llm"))])  # fmt: skip
    plan = compile_plan(config)
    family = get_family(config.model.family)
    hf_config = family.hf_config(config.model)
    links = links_of(family.handoffs_for(hf_config))
    workers = {}
    for name in ("vision", "llm"):
        spec = WorkerSpec(model=config.model, module=without_degrees(config.modules[name]), train=config.train,
                          layout=plan.layouts[name], device="cpu", handoff="object_store", links=links)  # fmt: skip
        workers[name] = ModuleWorker(module_name=name, rank=rank, world_size=world, spec=spec)
        workers[name].build()
    return workers, hf_config


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _LinearDtypes:
    """Forward hooks on every nn.Linear: the dtypes of (weight, input, output) each call saw."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.seen: collections.Counter = collections.Counter()
        self.handles = [
            m.register_forward_hook(self._hook)
            for mod in modules
            for m in mod.modules()
            if isinstance(m, nn.Linear)
        ]

    def _hook(self, m: nn.Module, args, out) -> None:
        self.seen[(m.weight.dtype, args[0].dtype, out.dtype)] += 1


def _step(rank: int, world: int, policy: str) -> dict:
    workers, cfg = _workers(rank, world, policy)
    vision, llm = workers["vision"], workers["llm"]
    (link,) = vision.links_out
    batch = VLBatch(**{k: v for k, v in tiny_vl_batch(cfg, images=[[(8, 8)], [(4, 8)]], text_lens=[6, 9],
                                                        seed=1).items()})  # fmt: skip
    shard = vision.family.shard_inputs("vision", cfg, pixel_values=batch.pixel_values,
                                       image_grid_thw=batch.image_grid_thw, sp_size=world)[rank]  # fmt: skip
    rows = len(shard.token_index)
    work = ProducerWork(
        shard=shard, routes=(Route(0, torch.arange(rows), shard.token_index),), num_tokens=rows
    )
    linears = _LinearDtypes([vision.module, llm.module])
    saved: collections.Counter = collections.Counter()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            saved[t.dtype] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        payload = vision.produce(work, 0, True)
        arrivals: list = [None] * world
        dist.all_gather_object(arrivals, payload)  # what the consumer replica reads from each unit
        leaf = llm._assemble(batch, link, arrivals, 0, requires_grad=True)
        out = llm.module(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels,
                         mm_token_type_ids=batch.mm_token_type_ids, image_grid_thw=batch.image_grid_thw,
                         sample_ids=batch.sample_ids, **link.split(leaf))  # fmt: skip
    (out.loss_sum / batch.num_label_tokens).backward()
    grad_rows = link.grad_of(leaf.grad)[torch.from_numpy(payload[1])]
    outputs, _ = vision._inflight.pop(0)
    torch.autograd.backward(*link.backward_pairs(outputs, grad_rows.to(next(iter(outputs.values())).dtype)))
    for w in (vision, llm):
        w.finalize_grads()
    params = {(n, f): p for n, w in workers.items() for f, p in w.module.named_parameters()}
    grads = {k: p.grad.dtype for k, p in params.items()}
    for w in (vision, llm):
        w.optimizer_step(lr=1e-3, clip_coef=1.0)
    tensors = [
        _local(t)
        for w in workers.values()
        for st in w.optimizer.state.values()
        for t in st.values()
        if t.dim() > 0
    ]  # fmt: skip  (exp_avg, exp_avg_sq; not the scalar step counts)
    states = {t.dtype for t in tensors}
    local = sum(_local(p).numel() for p in params.values())
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    return {
        "payload": payload[0],
        "leaf": (leaf.dtype, leaf.grad.dtype),
        "loss": out.loss_sum.dtype,
        "linears": linears.seen,
        "saved": saved,
        "params": {p.dtype for p in params.values()},
        "grads": set(grads.values()),
        "states": states,
        "state_bytes_per_element": state_bytes / local,
    }


def _master(rank: int, world: int) -> None:
    got = _step(rank, world, "bf16_master_fp32")
    assert isinstance(got["payload"], Bf16Bits), type(got["payload"])  # the rows travel as bf16
    assert got["leaf"] == (torch.bfloat16, torch.bfloat16)  # the LLM's hand-off leaf and its gradient
    assert got["loss"] == torch.float32
    assert set(got["linears"]) == {(torch.bfloat16,) * 3}, dict(got["linears"])  # every Linear computes bf16
    assert sum(got["linears"].values()) > 20
    assert got["saved"][torch.bfloat16] > 2 * got["saved"][torch.float32], dict(got["saved"])
    assert got["params"] == {torch.float32}  # bf16 weights upcast at build, still fp32 after the update
    assert got["grads"] == {torch.float32} and got["states"] == {torch.float32}
    assert got["state_bytes_per_element"] == 8.0


def _bf16(rank: int, world: int) -> None:
    got = _step(rank, world, "bf16")
    assert isinstance(got["payload"], Bf16Bits) and got["leaf"] == (torch.bfloat16, torch.bfloat16)
    assert set(got["linears"]) == {(torch.bfloat16,) * 3}
    assert got["params"] == got["grads"] == got["states"] == {torch.bfloat16}
    assert got["state_bytes_per_element"] == 4.0


def test_master_weights_stay_fp32_and_compute_is_bf16() -> None:
    spawn(_master, 2)


@pytest.mark.slow
def test_bf16_policy_stores_everything_in_bf16() -> None:
    spawn(_bf16, 2)
