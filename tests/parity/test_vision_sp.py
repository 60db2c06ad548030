"""Ulysses SP of the vision encoder against the single-process encoder, on gloo with 2 and 4 ranks.

Each rank builds the same seeded tiny encoder (dhp.models, unmodified transformers code), keeps an
untouched deep copy as the reference, applies SP, and for every case checks: the gathered output, the
loss, and EVERY parameter's full gradient after ``reduce_sp_grads``. Two loss placements are checked:
(a) each rank's loss on its own rows (the training path: hand-off of local rows, no gather), and
(b) a replicated loss on the gathered output (``gather_sp_output``'s slicing backward).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from parallel_harness import assert_grads_match, assert_rel_close, full_grads, spawn, vision_batch
from torch.distributed.device_mesh import init_device_mesh

from dhp.config.schema import TrainConfig
from dhp.layout import ParallelLayout
from dhp.models import get_family
from dhp.models.qwen2_5_vl.sp_shard import shard_vision_batch
from dhp.parallel import build_optimizer, finalize_grads, parallelize
from dhp.parallel.ac import AcSpec, apply_ac
from dhp.parallel.comm import CommCounter
from dhp.parallel.dp import Zero1AdamW
from dhp.parallel.optim import grad_norm_sq
from dhp.parallel.ulysses import UlyssesSpec, apply_ulysses_sp, gather_sp_output, reduce_sp_grads


def vision_shard_forward(module, shard):
    """The producer's own forward on its SP shard (what the runtime calls)."""
    return module(**shard.forward_kwargs())["image_embeds"]


# fp32 on CPU: SP changes only the summation order (per-image attention split by heads, partial
# gradient sums reduced over ranks); measured ~1e-7 relative. Contract: <= 1e-5 relative (norm sense).
RTOL = 1e-5

pytestmark = pytest.mark.parity

# window 112 px = 8x8 patches = 64 patches; (1, 8, 8) is one window, (1, 16, 24) six, (1, 8, 12) two.
CASES = {
    "one_image": [(1, 16, 24)],
    "two_unequal_images": [(1, 16, 24), (1, 8, 12)],
    "fewer_windows_than_ranks": [(1, 8, 8)],
    "two_images_one_window_each": [(1, 8, 8), (1, 4, 8)],
}


def _tiny_hf_vision():
    """The tiny encoder's transformers config (its window geometry is what the SP cut reads)."""
    family = get_family("qwen2_5_vl")
    return family.hf_config(family.tiny_model_config()).vision_config


def _tiny_vision():
    family = get_family("qwen2_5_vl")
    model_cfg = family.tiny_model_config()
    torch.manual_seed(0)
    hf = family.hf_config(model_cfg)
    module = family.build_module("vision", hf, device="cpu", dtype=torch.float32)
    return module, hf.vision_config


def _grads(module) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in module.named_parameters()}


def _check_case(module, ref, group, rank: int, world: int, case: str, *, gathered: bool = True) -> None:
    batch = vision_batch(seed=len(case), grids=CASES[case])
    pixels, thw = batch["pixel_values"], batch["image_grid_thw"]
    arch = _tiny_hf_vision()
    ref.zero_grad(set_to_none=True)
    ref_out = ref(pixels, thw)["image_embeds"]
    weights = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(7))
    ref_loss = (ref_out * weights).sum()
    ref_loss.backward()
    want = _grads(ref)

    shard = shard_vision_batch(pixels, thw, sp_size=world, arch=arch)[rank]
    tag = f"{case} sp={world} rank={rank} ({shard.num_patches} patches, training={module.training})"
    # (a) training path: loss on this rank's own rows only, grads summed over SP
    module.zero_grad(set_to_none=True)
    local = vision_shard_forward(module, shard)
    assert local.shape == (shard.token_index.numel(), ref_out.shape[1]), tag
    loss = (local * weights[shard.token_index]).sum()
    loss.backward()
    reduce_sp_grads(module, group)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    assert_rel_close(total, ref_loss, rtol=RTOL, name=f"{tag}: loss")
    out = gather_sp_output(local.detach(), shard, group)
    assert_rel_close(out, ref_out, rtol=RTOL, name=f"{tag}: out")
    assert_grads_match(_grads(module), want, rtol=RTOL, tag=f"{tag} local-loss")
    if not gathered:
        return
    # (b) replicated loss on the gathered output
    module.zero_grad(set_to_none=True)
    full = gather_sp_output(vision_shard_forward(module, shard), shard, group)
    (full * weights).sum().backward()
    reduce_sp_grads(module, group)
    assert_grads_match(_grads(module), want, rtol=RTOL, tag=f"{tag} gathered-loss")


def _sp_cases(rank: int, world: int) -> None:
    module, _ = _tiny_vision()
    ref = copy.deepcopy(module)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    group = mesh.get_group("sp")
    apply_ulysses_sp(module, mesh, UlyssesSpec())
    for case in CASES:
        _check_case(module, ref, group, rank, world, case)

    # CommCounter sees the all-to-alls: 2 per full-attention block in forward, 2 in backward
    shard = shard_vision_batch(**vision_batch(seed=3, grids=CASES["fewer_windows_than_ranks"]), sp_size=world,
                               arch=_tiny_hf_vision())[rank]  # fmt: skip
    counter = CommCounter("vision")
    with counter:
        vision_shard_forward(module, shard).sum().backward()
    stats = counter.step()
    # 2 full-attention blocks x (seq->head, head->seq) x (forward, backward), + 1 rotary-table gather
    assert stats["vision/all_to_all"].calls == 2 * 2 * 2 + 1, stats

    # activation checkpointing (transformers' own) recomputes the blocks, all-to-alls included, in
    # backward; a rank with no tokens must recompute in step with the others
    module.train()
    ref.train()
    apply_ac(module, mesh, AcSpec())
    for case in ("two_unequal_images", "fewer_windows_than_ranks"):
        _check_case(module, ref, group, rank, world, case, gathered=False)

    # selective AC replays each block op by op; the rotary-table gather runs in the first block's
    # forward and, once a newer forward has replaced the cached tables (the runtime runs micro-batch
    # i+1's encoder forward before i's backward), again in a recompute: both passes must still line up
    apply_ac(module, mesh, AcSpec(kind="selective"))
    batches = [shard_vision_batch(**vision_batch(seed=s, grids=CASES["two_unequal_images"]), sp_size=world,
                                  arch=_tiny_hf_vision())[rank]
               for s in (11, 12)]  # fmt: skip
    outs = [vision_shard_forward(module, b) for b in batches]  # two forwards in flight, then backwards
    for out in outs:
        out.sum().backward()
    for case in ("two_unequal_images", "fewer_windows_than_ranks"):
        _check_case(module, ref, group, rank, world, case, gathered=False)


def test_vision_sp2_matches_single_process() -> None:
    spawn(_sp_cases, 2)


@pytest.mark.slow
def test_vision_sp4_matches_single_process() -> None:
    spawn(_sp_cases, 4)


def _dp_sp_cases(rank: int, world: int) -> None:
    """DP x SP = 2 x 2 through ``parallelize`` + ``finalize_grads``: each replica its own micro-batch."""
    module, arch = _tiny_vision()
    ref = copy.deepcopy(module)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    parallel = ParallelLayout(dp=2, sp=2)
    module = parallelize(
        "vision", module, mesh, layout=parallel, activation_checkpointing=False, mixed_precision="fp32"
    )
    replicas = [
        vision_batch(seed=11, grids=[(1, 16, 24)]),
        vision_batch(seed=12, grids=[(1, 8, 12), (1, 8, 8)]),
    ]
    weights, ref_loss = [], torch.zeros(())
    for batch in replicas:  # the reference sees both micro-batches in one process
        out = ref(batch["pixel_values"], batch["image_grid_thw"])["image_embeds"]
        weights.append(torch.randn(out.shape, generator=torch.Generator().manual_seed(out.shape[0])))
        ref_loss = ref_loss + (out * weights[-1]).sum()
    ref_loss.backward()
    dp_rank, sp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("sp")
    batch = replicas[dp_rank]
    shard = shard_vision_batch(batch["pixel_values"], batch["image_grid_thw"], sp_size=2, arch=arch)[sp_rank]
    local = vision_shard_forward(module, shard)
    loss = (local * weights[dp_rank][shard.token_index]).sum()
    loss.backward()
    finalize_grads(module, mesh, layout=parallel)
    total = loss.detach().clone()
    dist.all_reduce(total)
    tag = f"dp x sp = 2 x 2, rank {rank} (dp {dp_rank}, sp {sp_rank})"
    assert_rel_close(total, ref_loss, rtol=RTOL, name=f"{tag}: loss")
    assert_grads_match(_grads(module), _grads(ref), rtol=RTOL, tag=tag)
    _check_zero1_over_dp_sp(module, mesh, parallel, tag)


def _check_zero1_over_dp_sp(module, mesh, parallel: ParallelLayout, tag: str) -> None:
    """ZeRO-1 shards the encoder's optimizer over dp x sp (all 4 ranks hold the same summed grads).

    After one step its params equal plain AdamW's on the same grads (same arithmetic: <= 1e-6), and
    this rank holds about 1/4 of the optimizer state elements.
    """
    train = TrainConfig(lr=1e-2, weight_decay=0.1)
    twins = [p.detach().clone().requires_grad_() for p in module.parameters()]
    for p, q in zip(module.parameters(), twins, strict=True):
        q.grad = p.grad.detach().clone()
    zero = build_optimizer(module, mesh, layout=ParallelLayout(dp=2, sp=2, zero=1), train=train)
    plain = torch.optim.AdamW(twins, lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay)
    assert isinstance(zero, Zero1AdamW) and dist.get_world_size(zero._group) == 4, tag
    zero.step()
    plain.step()
    for (k, p), q in zip(module.named_parameters(), twins, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6, msg=f"{tag}: zero-1 {k}")
    held = sum(s["exp_avg"].numel() for s in zero.state.values())
    total = sum(p.numel() for p in module.parameters())
    assert held < 0.4 * total, f"{tag}: ZeRO-1 over dp x sp (4 ranks) holds {held}/{total} state elements"


@pytest.mark.slow
def test_vision_dp2_x_sp2_matches_single_process() -> None:
    spawn(_dp_sp_cases, 4)


# bf16 parameters and compute (8 mantissa bits, unit roundoff ~2e-3) through 4 blocks, the all-to-alls
# and a bf16 SUM of gradients over SP, against the fp32 single process. Measured (relative, norm sense):
# output 5.8e-3, loss 1.3e-2 (a signed sum: cancellation), worst gradient 1.3e-2. Documented looser
# bound: output <= 2e-2; loss and every gradient <= 5e-2.
BF16_OUT_RTOL = 2e-2
BF16_GRAD_RTOL = 5e-2


def _bf16_case(rank: int, world: int) -> None:
    module, arch = _tiny_vision()
    ref = copy.deepcopy(module)
    module = module.to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    apply_ulysses_sp(module, mesh, UlyssesSpec())
    batch = vision_batch(seed=5, grids=CASES["two_unequal_images"])
    ref_out = ref(batch["pixel_values"], batch["image_grid_thw"])["image_embeds"]
    weights = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(7))
    ref_loss = (ref_out * weights).sum()
    ref_loss.backward()
    shard = shard_vision_batch(batch["pixel_values"], batch["image_grid_thw"], sp_size=world, arch=arch)[rank]
    local = vision_shard_forward(module, shard)
    assert local.dtype == torch.bfloat16
    loss = (local.float() * weights[shard.token_index]).sum()
    loss.backward()
    reduce_sp_grads(module, mesh.get_group("sp"))
    dist.all_reduce(loss)
    tag = f"bf16 sp={world} rank={rank}"
    assert_rel_close(loss, ref_loss, rtol=BF16_GRAD_RTOL, name=f"{tag}: loss")
    out = gather_sp_output(local.detach().float(), shard, mesh.get_group("sp"))
    assert_rel_close(out, ref_out, rtol=BF16_OUT_RTOL, name=f"{tag}: out")
    assert_grads_match(
        {k: g.float() for k, g in _grads(module).items()}, _grads(ref), rtol=BF16_GRAD_RTOL, tag=tag
    )


def test_vision_sp2_bf16_within_documented_tolerance() -> None:
    spawn(_bf16_case, 2)


def _fsdp_sp_cases(rank: int, world: int) -> None:
    """FSDP x SP = 2 x 2 through ``parallelize`` + ``finalize_grads``: each FSDP rank its own micro-batch,
    cut over its SP group. FSDP reduce-scatters each shard's grads over fsdp (a SUM); the SP SUM then
    adds the local shards over sp (same shard index on both SP ranks), so every rank ends with its
    1/fsdp slice of the full gradient."""
    module, arch = _tiny_vision()
    ref = copy.deepcopy(module)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "sp"))
    parallel = ParallelLayout(fsdp=2, sp=2)
    module = parallelize(
        "vision", module, mesh, layout=parallel, activation_checkpointing="full", mixed_precision="fp32"
    )
    replicas = [
        vision_batch(seed=21, grids=[(1, 16, 24)]),
        vision_batch(seed=22, grids=[(1, 8, 12), (1, 8, 8)]),
    ]
    weights, ref_loss = [], torch.zeros(())
    for batch in replicas:
        out = ref(batch["pixel_values"], batch["image_grid_thw"])["image_embeds"]
        weights.append(torch.randn(out.shape, generator=torch.Generator().manual_seed(out.shape[0])))
        ref_loss = ref_loss + (out * weights[-1]).sum()
    ref_loss.backward()
    f_rank, sp_rank = mesh.get_local_rank("fsdp"), mesh.get_local_rank("sp")
    batch = replicas[f_rank]
    shard = shard_vision_batch(batch["pixel_values"], batch["image_grid_thw"], sp_size=2, arch=arch)[sp_rank]
    loss = (vision_shard_forward(module, shard) * weights[f_rank][shard.token_index]).sum()
    loss.backward()
    finalize_grads(module, mesh, layout=parallel)
    total = loss.detach().clone()
    dist.all_reduce(total)
    tag = f"fsdp x sp = 2 x 2, rank {rank} (fsdp {f_rank}, sp {sp_rank})"
    assert_rel_close(total, ref_loss, rtol=RTOL, name=f"{tag}: loss")
    assert_grads_match(full_grads(module), _grads(ref), rtol=RTOL, tag=tag)
    norm = grad_norm_sq(module, mesh)
    want = sum(g.double().pow(2).sum().item() for g in _grads(ref).values())
    assert abs(norm - want) <= RTOL * want, f"{tag}: grad norm^2 {norm} != {want}"


def test_vision_fsdp2_x_sp2_matches_single_process() -> None:
    spawn(_fsdp_sp_cases, 4)
