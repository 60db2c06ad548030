"""Encoder tensor parallelism (fused-qkv strided sharding) against the single-process encoder, on gloo.

Each rank builds the same seeded tiny encoder (dhp.models), keeps a deep copy as the reference, applies
TP, and checks the (replicated) output, the loss and EVERY parameter's full gradient (DTensor grads
gathered), plus that each weight is really sharded and its logical full tensor is transformers' own.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from parallel_harness import assert_grads_match, assert_rel_close, full_grads, spawn, vision_batch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dhp.errors import PlanError
from dhp.models import get_family
from dhp.models.qwen2_5_vl.parallel import vision_tp_plan
from dhp.parallel.llm_tp import apply_tp, check_divides, match_plan
from dhp.parallel.state import full_param_dict
from dhp.parallel.vision_tp import fused_moves

apply_vision_tp = apply_tp  # one TP applier for every module: the plan comes from the module's family

# fp32 on CPU: TP changes only the summation order (row-parallel all-reduce, sharded matmuls);
# measured ~1e-7 relative. Contract: <= 1e-5 relative (norm sense) for every tensor.
RTOL = 1e-5

CASES = {"one_image": [(1, 16, 24)], "two_unequal_images": [(1, 16, 24), (1, 8, 12)]}


def _tiny_vision(intermediate_size: int | None = None):
    family = get_family("qwen2_5_vl")
    cfg = family.tiny_model_config()
    if intermediate_size is not None:
        cfg = dataclasses.replace(
            cfg, vision=dataclasses.replace(cfg.vision, intermediate_size=intermediate_size)
        )
    torch.manual_seed(0)
    return family.build_module("vision", family.hf_config(cfg), device="cpu", dtype=torch.float32)


@pytest.mark.unit
def test_every_encoder_linear_matches_exactly_one_glob() -> None:
    module = _tiny_vision()
    matches = match_plan(module, vision_tp_plan())
    linears = {fqn for fqn, m in module.named_modules() if isinstance(m, nn.Linear)}
    assert linears, "tiny encoder has no Linear?"
    for fqn in linears:
        assert len(matches[fqn]) == 1, f"{fqn} matches {matches[fqn]}"
    assert all(not globs for fqn, globs in matches.items() if fqn not in linears)


@pytest.mark.unit
def test_divisibility_errors_name_every_dimension() -> None:
    sizes = {"vision num_heads": 16, "vision merger hidden": 5120}
    with pytest.raises(PlanError, match=r"tp=3 must divide vision num_heads=16, vision merger hidden=5120"):
        check_divides(sizes, degree=3, axis="tp", module="vision")
    check_divides(sizes, degree=8, axis="tp", module="vision")  # MLP width 3420 may be uneven (not listed)


@pytest.mark.unit
def test_fused_moves_give_each_rank_its_heads_of_q_k_and_v() -> None:
    for world in (1, 2, 3, 4, 8):
        hidden = 4 * world
        rows = torch.arange(3 * hidden)  # HF fused layout q|k|v, row ids
        shards = list(rows.chunk(world))  # Shard(0): rank s holds blocks 3s..3s+2
        block = hidden // world
        got = {r: {} for r in range(world)}
        for m in fused_moves(world, 3):
            got[m.dst][m.dst_pos] = shards[m.src][m.src_pos * block : (m.src_pos + 1) * block]
        for r in range(world):
            local = torch.cat([got[r][p] for p in range(3)])
            want = rows.view(3, world, block)[:, r].reshape(-1)
            assert torch.equal(local, want), (world, r)


def _check_model(rank: int, world: int, intermediate_size: int | None) -> None:
    module = _tiny_vision(intermediate_size)
    ref = copy.deepcopy(module)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    apply_vision_tp(module, mesh)
    qkv = module.visual.blocks[0].attn.qkv.weight
    assert isinstance(qkv, DTensor) and qkv.to_local().shape == (3 * 32 // world, 32)
    # the logical full tensors are transformers' own (q|k|v order kept): DCP reshards TP <-> non-TP
    ref_params = dict(ref.named_parameters())
    for name, full in full_param_dict(module).items():
        assert torch.equal(full, ref_params[name].detach()), f"rank {rank}: full param {name} differs"
    # storage is a plain Shard(0) of transformers' q|k|v rows (DCP-friendly); compute uses [q_r; k_r; v_r]
    assert qkv.placements == (Shard(0),)
    assert torch.equal(qkv.to_local(), ref.visual.blocks[0].attn.qkv.weight.detach().chunk(world)[rank])
    width = ref.visual.blocks[0].mlp.down_proj.weight.shape[1]
    want_cols = torch.arange(width).chunk(world)[rank].numel()  # uneven widths: torch.chunk sizes
    assert module.visual.blocks[0].mlp.down_proj.weight.to_local().shape == (32, want_cols)
    for case, grids in CASES.items():
        batch = vision_batch(seed=len(case), grids=grids)
        ref.zero_grad(set_to_none=True)
        ref_out = ref(batch["pixel_values"], batch["image_grid_thw"])["image_embeds"]
        weights = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(7))
        ref_loss = (ref_out * weights).sum()
        ref_loss.backward()
        want = {k: p.grad.detach().clone() for k, p in ref.named_parameters()}

        module.zero_grad(set_to_none=True)
        out = module(batch["pixel_values"], batch["image_grid_thw"])["image_embeds"]
        loss = (out * weights).sum()
        loss.backward()
        tag = f"{case} tp={world} mlp={width} rank={rank}"
        assert_rel_close(out, ref_out, rtol=RTOL, name=f"{tag}: out")
        assert_rel_close(loss, ref_loss, rtol=RTOL, name=f"{tag}: loss")
        assert_grads_match(full_grads(module), want, rtol=RTOL, tag=tag)


def _tp_cases(rank: int, world: int) -> None:
    _check_model(rank, world, None)  # tiny MLP width 64: even shards
    _check_model(rank, world, 63)  # 63 = uneven at TP=2 and TP=4 (like 3420 at TP=8)


@pytest.mark.parity
def test_vision_tp2_matches_single_process() -> None:
    spawn(_tp_cases, 2)


@pytest.mark.parity
@pytest.mark.slow
def test_vision_tp4_matches_single_process() -> None:
    spawn(_tp_cases, 4)


def _dcp_ranks(rank: int, world: int, root: str) -> None:
    from dhp.checkpoint.module_state import load_module_state, save_module_state

    want = dict(_tiny_vision().named_parameters())  # seed 0: what the plain process saved
    module = apply_vision_tp(_other_seed(), init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    load_module_state(Path(root, "plain"), model=module, optimizer=None)
    for name, full in full_param_dict(module).items():
        assert torch.equal(full, want[name].detach()), f"plain -> tp={world}: {name}"
    save_module_state(Path(root, "tp"), model=module, optimizer=None)


def _other_seed():
    family = get_family("qwen2_5_vl")
    torch.manual_seed(123)
    return family.build_module(
        "vision", family.hf_config(family.tiny_model_config()), device="cpu", dtype=torch.float32
    )


@pytest.mark.parity
def test_vision_tp2_checkpoint_reshards_to_and_from_a_plain_process(tmp_path) -> None:
    from dhp.checkpoint.module_state import load_module_state, save_module_state

    save_module_state(tmp_path / "plain", model=_tiny_vision(), optimizer=None)
    spawn(_dcp_ranks, 2, str(tmp_path))
    plain = _other_seed()
    load_module_state(tmp_path / "tp", model=plain, optimizer=None)
    want = dict(_tiny_vision().named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), want[name].detach()), f"tp=2 -> plain: {name}"
