"""Ulysses SP of Qwen2.5-Omni's vision encoder (three q/k/v Linears, one all-to-all each in every
full-attention block) against the single-process encoder, on gloo with 2 ranks.

Each rank builds the same seeded tiny encoder, keeps an untouched deep copy as the reference, applies
SP, and checks the gathered output, the loss and EVERY parameter's full gradient after
``reduce_sp_grads``, with and without transformers' activation checkpointing (the all-to-alls recomputed
in backward). fp32: SP changes only the summation order; <= 1e-5 relative (norm sense), as for
Qwen2.5-VL's fused qkv (tests/parity/test_vision_sp.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from parallel_harness import assert_grads_match, assert_rel_close, spawn, vision_batch
from torch.distributed.device_mesh import init_device_mesh

from dhp.models import get_family
from dhp.parallel.ac import AcSpec, apply_ac
from dhp.parallel.comm import CommCounter
from dhp.parallel.ulysses import UlyssesSpec, apply_ulysses_sp, gather_sp_output, reduce_sp_grads

pytestmark = pytest.mark.parity
RTOL = 1e-5
# window 112 px = 8x8 patches; (1, 16, 24) is six windows, (1, 8, 12) two, a video (2, 8, 8) two frames
GRIDS = [(1, 16, 24), (1, 8, 12), (2, 8, 8)]


def _check(module, ref, family, hf_config, group, rank: int, world: int, tag: str) -> None:
    batch = vision_batch(seed=3, grids=GRIDS)
    ref.zero_grad(set_to_none=True)
    want_out = ref(batch["pixel_values"], batch["image_grid_thw"])["image_embeds"]
    weights = torch.randn(want_out.shape, generator=torch.Generator().manual_seed(7))
    (want_out * weights).sum().backward()
    want = {k: p.grad.clone() for k, p in ref.named_parameters()}
    shard = family.shard_inputs(
        "vision", hf_config, rows=batch["pixel_values"], meta=batch["image_grid_thw"], sp_size=world
    )[rank]
    module.zero_grad(set_to_none=True)
    local = module(**shard.forward_kwargs())["image_embeds"]
    loss = (local * weights[shard.token_index]).sum()
    loss.backward()
    reduce_sp_grads(module, group)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    assert_rel_close(total, (want_out * weights).sum(), rtol=RTOL, name=f"{tag}: loss")
    assert_rel_close(gather_sp_output(local.detach(), shard, group), want_out, rtol=RTOL, name=f"{tag}: out")
    assert_grads_match({k: p.grad for k, p in module.named_parameters()}, want, rtol=RTOL, tag=tag)


def _ranks(rank: int, world: int) -> None:
    family = get_family("qwen2_5_omni")
    hf_config = family.hf_config(family.tiny_model_config())
    torch.manual_seed(0)
    module = family.build_module("vision", hf_config, device="cpu", dtype=torch.float32)
    ref = copy.deepcopy(module)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    group = mesh.get_group("sp")
    apply_ulysses_sp(module, mesh, UlyssesSpec())
    counter = CommCounter("vision")
    with counter:
        _check(module, ref, family, hf_config, group, rank, world, f"sp={world} rank={rank}")
    # 2 full-attention blocks x 3 projections x (seq->head fwd, head->seq bwd) + 2 x (out: head->seq
    # fwd, seq->head bwd) + 1 rotary-table gather
    assert counter.step()["vision/all_to_all"].calls == 2 * (3 * 2 + 2) + 1
    module.train()
    ref.train()
    apply_ac(module, mesh, AcSpec())
    _check(module, ref, family, hf_config, group, rank, world, f"sp={world} rank={rank} AC")


def test_omni_vision_ulysses_sp_matches_the_whole_encoder():
    spawn(_ranks, 2)
