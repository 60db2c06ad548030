"""Qwen3-VL encoder under tensor parallelism (TP=2, gloo): every edge and every gradient vs one process.

Each rank builds the same seeded vision module twice, shards one with the family's own TP plan by FQN
(``family.parallel_plan("vision", ...)``: fused qkv, attention proj, MLP, the merger and every DeepStack
merger) through torch's ``parallelize_module``, runs the same images, and backpropagates the same
cotangent into each of the 1 + K outputs (what the LLM sends back along each edge). fp32: sharded matmuls
and all-reduces only reorder sums; measured ~1e-7, asserted <= 1e-5 relative (norm sense) per tensor.
"""

from __future__ import annotations

import fnmatch

import pytest
import torch
from parallel_harness import assert_grads_match, assert_rel_close, full_grads, spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from dhp.models import get_family
from dhp.models.testing import tiny_vl_batch

pytestmark = pytest.mark.parity
RTOL = 1e-5


def _run(rank: int, world: int) -> None:
    family = get_family("qwen3_vl")
    cfg = family.tiny_hf_config()
    batch = tiny_vl_batch(cfg, images=[[(8, 6), (4, 10)], [(6, 6)]], text_lens=[3, 4], seed=3)

    def build():
        torch.manual_seed(0)
        return family.build_module("vision", cfg, device="cpu", dtype=torch.float32)

    ref, tp = build(), build()
    plan = tp.parallel_plan
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(tp, mesh, dict(plan.tp(False)))
    for fqn, sub in tp.named_modules():
        if any(fnmatch.fnmatchcase(fqn, g) for g in plan.tp_heads):
            sub.num_heads //= world

    gen = torch.Generator().manual_seed(7)
    ref_out = ref(batch["pixel_values"], batch["image_grid_thw"])
    tp_out = tp(batch["pixel_values"], batch["image_grid_thw"])
    assert set(tp_out) == {e.kwarg for e in family.handoffs_for(cfg)} and len(tp_out) == 3
    cotangents = {k: torch.randn(v.shape, generator=gen) for k, v in ref_out.items()}
    for name in ref_out:
        assert_rel_close(tp_out[name], ref_out[name], rtol=RTOL, name=f"rank {rank} {name}")
    torch.autograd.backward([ref_out[k] for k in cotangents], list(cotangents.values()))
    torch.autograd.backward([tp_out[k] for k in cotangents], list(cotangents.values()))
    got, want = full_grads(tp), {n: p.grad for n, p in ref.named_parameters()}
    assert set(got) == set(want)
    assert any(n.startswith("visual.deepstack_merger_list.1.") for n in got)
    assert_grads_match(got, want, rtol=RTOL, tag=f"rank {rank}")


def test_qwen3_vl_vision_tp2_matches_one_process() -> None:
    spawn(_run, 2)
