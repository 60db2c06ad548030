"""FSDP2 (fully_shard per block, then the root) for the LLM and the vision module, against the
single-process module on the whole batch, through ``parallelize``.

Each FSDP rank runs a different part of the batch with the loss pre-divided by the GLOBAL label-token
count, so the reduce-scattered gradients must be SUMS; the check covers the summed loss, every
parameter's full gradient, the input-embedding gradient of each rank's rows, and grad_norm_sq.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_harness import (
    assert_grads_match,
    assert_rel_close,
    build_llm,
    build_vision,
    full_grads,
    llm_batch,
    llm_step,
    ref_norm_sq,
    spawn,
    split_llm,
    vision_batch,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dhp.layout import ParallelLayout
from dhp.parallel import CommCounter, finalize_grads, grad_norm_sq, parallelize

# fp32 on CPU: only the reduction order differs (all-gathered weights are exact copies); the contract
# is <= 1e-5 relative (norm sense) for the loss and every tensor.
RTOL = 1e-5

pytestmark = pytest.mark.parity


def _llm_case(rank: int, world: int, mesh, parallel: ParallelLayout) -> None:
    batch = llm_batch(seed=2, batch=4)
    num_tokens = int((batch["labels"][:, 1:] != -100).sum())
    ref = build_llm()
    ref_loss, ref_gin = llm_step(ref, batch, num_tokens)
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}

    model = parallelize(
        "llm", build_llm(), mesh, layout=parallel, activation_checkpointing=False, mixed_precision="fp32"
    )
    assert isinstance(model.language_model.layers[0].mlp.up_proj.weight, DTensor)
    counter = CommCounter("llm")
    with counter:
        loss, gin = llm_step(model, split_llm(batch, rank, world), num_tokens)
        finalize_grads(model, mesh, layout=parallel)
    comm = counter.step()
    dist.all_reduce(loss)
    assert_rel_close(loss, ref_loss, rtol=RTOL, name="fsdp llm loss")
    # FSDP2 only all-gathers shards and reduce-scatters full fp32 grads (dim-0 padding aside)
    full_bytes = 4 * sum(p.numel() for p in ref.parameters())
    assert set(comm) == {"llm/all_gather", "llm/reduce_scatter"}, comm
    assert full_bytes <= comm["llm/reduce_scatter"].payload_bytes <= 1.02 * full_bytes, comm
    assert comm["llm/all_gather"].payload_bytes >= full_bytes / world, comm
    assert_rel_close(
        gin,
        split_llm({**batch, "image_embeds": ref_gin}, rank, world)["image_embeds"],
        rtol=RTOL,
        name="fsdp llm d/d embeds",
    )
    assert_grads_match(full_grads(model), ref_grads, rtol=RTOL, tag="fsdp llm")
    assert abs(grad_norm_sq(model, mesh) - ref_norm_sq(ref_grads)) <= RTOL * ref_norm_sq(ref_grads)


def _vision_case(rank: int, world: int, mesh, parallel: ParallelLayout) -> None:
    grids = [(1, 8, 8), (1, 4, 8), (1, 4, 4)]  # 16 + 8 + 4 merged tokens
    per_rank = [[0], [1, 2]]
    w = torch.randn(28, 128, generator=torch.Generator().manual_seed(9))
    ref = build_vision()
    (ref(**vision_batch(3, grids)) * w).sum().backward()
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}

    full = vision_batch(3, grids)
    rows = torch.tensor(grids).prod(-1).cumsum(0).tolist()
    starts = [0, *rows[:-1]]
    mine = per_rank[rank]
    pix = torch.cat([full["pixel_values"][starts[i] : rows[i]] for i in mine])
    tok0 = [0, 16, 24][mine[0]]
    toks = sum(torch.tensor(grids[i]).prod().item() // 4 for i in mine)
    # AC on top of FSDP: recomputation inside FSDP units must not change the math either
    model = parallelize(
        "vision",
        build_vision(),
        mesh,
        layout=parallel,
        activation_checkpointing=True,
        mixed_precision="fp32",
    )
    out = model(pix, full["image_grid_thw"][mine])
    (out * w[tok0 : tok0 + toks]).sum().backward()
    finalize_grads(model, mesh, layout=parallel)
    assert_grads_match(full_grads(model), ref_grads, rtol=RTOL, tag="fsdp+ac vision")
    assert abs(grad_norm_sq(model, mesh) - ref_norm_sq(ref_grads)) <= RTOL * ref_norm_sq(ref_grads)


def _fsdp_cases(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    parallel = ParallelLayout(fsdp=world)
    _llm_case(rank, world, mesh, parallel)
    _vision_case(rank, world, mesh, parallel)


def test_fsdp2_llm_and_vision_match_single_process() -> None:
    spawn(_fsdp_cases, 2)


def _fsdp_tp_case(rank: int, world: int) -> None:
    """2-D LLM: FSDP2 over TP DTensors (fsdp x tp = 2 x 2, _StridedShard placements) plus AC."""
    batch = llm_batch(seed=8, batch=4)
    num_tokens = int((batch["labels"][:, 1:] != -100).sum())
    ref = build_llm()
    ref_loss, _ = llm_step(ref, batch, num_tokens)
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    parallel = ParallelLayout(fsdp=2, tp=2)
    model = parallelize(
        "llm", build_llm(), mesh, layout=parallel, activation_checkpointing=True, mixed_precision="fp32"
    )
    loss, _ = llm_step(model, split_llm(batch, mesh["fsdp"].get_local_rank(), 2), num_tokens)
    finalize_grads(model, mesh, layout=parallel)
    dist.all_reduce(loss, group=mesh["fsdp"].get_group())
    assert_rel_close(loss, ref_loss, rtol=RTOL, name="fsdp x tp loss")
    assert_grads_match(full_grads(model), ref_grads, rtol=RTOL, tag="fsdp x tp + ac")
    # grad_norm_sq counts each logical element once across both shardings
    assert abs(grad_norm_sq(model, mesh) - ref_norm_sq(ref_grads)) <= RTOL * ref_norm_sq(ref_grads)


def _hsdp_case(rank: int, world: int) -> None:
    """HSDP: dp x fsdp = 2 x 2, replicated over dp and sharded over fsdp; each of 4 ranks its own rows."""
    batch = llm_batch(seed=10, batch=4)
    num_tokens = int((batch["labels"][:, 1:] != -100).sum())
    ref = build_llm()
    ref_loss, _ = llm_step(ref, batch, num_tokens)
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "fsdp"))
    parallel = ParallelLayout(dp=2, fsdp=2)
    model = parallelize(
        "llm", build_llm(), mesh, layout=parallel, activation_checkpointing=False, mixed_precision="fp32"
    )
    loss, _ = llm_step(model, split_llm(batch, rank, world), num_tokens)
    finalize_grads(model, mesh, layout=parallel)  # must not all-reduce over dp again
    dist.all_reduce(loss)
    assert_rel_close(loss, ref_loss, rtol=RTOL, name="hsdp loss")
    assert_grads_match(full_grads(model), ref_grads, rtol=RTOL, tag="hsdp")
    assert abs(grad_norm_sq(model, mesh) - ref_norm_sq(ref_grads)) <= RTOL * ref_norm_sq(ref_grads)


def _fsdp_2d_cases(rank: int, world: int) -> None:
    _fsdp_tp_case(rank, world)
    _hsdp_case(rank, world)


@pytest.mark.slow
def test_fsdp2_2d_meshes_match_single_process() -> None:
    """FSDP x TP = 2x2 with AC, and HSDP dp x fsdp = 2x2 (one 4-rank spawn)."""
    spawn(_fsdp_2d_cases, 4)
