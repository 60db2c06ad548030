"""DP (gradient SUM across replicas), DP x TP = 2 x 2, ZeRO-1 and the collective byte counter, on gloo.

Scaling contract: every replica divides its loss SUM by the GLOBAL label-token count, so DP=2 on two
different halves of a batch must give exactly the single-process gradients of the whole batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from parallel_harness import (
    assert_grads_match,
    assert_rel_close,
    build_llm,
    full_grads,
    llm_batch,
    llm_step,
    ref_norm_sq,
    spawn,
    split_llm,
)
from torch.distributed.device_mesh import init_device_mesh

from dhp.config.schema import TrainConfig
from dhp.layout import ParallelLayout
from dhp.parallel import CommCounter, build_optimizer, finalize_grads, grad_norm_sq, parallelize
from dhp.parallel.dp import Zero1AdamW, local
from dhp.parallel.state import full_param_dict

# fp32 on CPU: gradients differ from the single process only by reduction order, bound <= 1e-5
# relative (norm sense). ZeRO-1 vs plain DP run the same AdamW arithmetic on the same grads: <= 1e-6.
RTOL = 1e-5
ZERO_ATOL = 1e-6
TRAIN = TrainConfig(lr=1e-2, weight_decay=0.1)

pytestmark = pytest.mark.parity


def _reference(batch: dict, num_tokens: int):
    ref = build_llm()
    loss, gin = llm_step(ref, batch, num_tokens)
    return loss, gin, {k: p.grad for k, p in ref.named_parameters()}


def _dp_replica(mesh, parallel: ParallelLayout, batch: dict, dp_rank: int, dp: int):
    """Build, parallelize, run this replica's half, finalize; returns (model, summed loss, input grad)."""
    num_tokens = int((batch["labels"][:, 1:] != -100).sum())
    model = parallelize(
        "llm", build_llm(), mesh, layout=parallel, activation_checkpointing=False, mixed_precision="fp32"
    )
    loss, gin = llm_step(model, split_llm(batch, dp_rank, dp), num_tokens)
    counter = CommCounter("llm")
    with counter:
        finalize_grads(model, mesh, layout=parallel)
    dist.all_reduce(loss, group=mesh["dp"].get_group())
    return model, loss, gin, counter.step()


def _check_zero1(mesh, parallel: ParallelLayout, model) -> None:
    """ZeRO-1 and plain AdamW on identical grads: params equal after a step; states sharded over dp."""
    twin = parallelize(
        "llm", build_llm(), mesh, layout=parallel, activation_checkpointing=False, mixed_precision="fp32"
    )
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        q.grad = p.grad.detach().clone()
    zero = build_optimizer(
        model, mesh, layout=ParallelLayout(**{**parallel.__dict__, "zero": 1}), train=TRAIN
    )
    plain = build_optimizer(twin, mesh, layout=parallel, train=TRAIN)
    assert isinstance(zero, Zero1AdamW) and not isinstance(plain, Zero1AdamW)
    hooks: list[str] = []
    zero.register_step_pre_hook(lambda *_: hooks.append("pre"))
    zero.register_step_post_hook(lambda *_: hooks.append("post"))
    zero.step()
    plain.step()
    # once each, although a plain AdamW (whose step torch wraps too) exists in this process
    assert hooks == ["pre", "post"], hooks
    got, want = full_param_dict(model), full_param_dict(twin)
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=0, atol=ZERO_ATOL), (
            f"zero-1 param {k} differs from plain DP"
        )
    held = torch.tensor(float(sum(local(s["exp_avg"]).numel() for s in zero.state.values())))
    total = sum(local(p).numel() for p in model.parameters())
    everyone = held.clone()
    dist.all_reduce(everyone, group=mesh["dp"].get_group())
    assert int(everyone) == total, "each parameter's state must live on exactly one dp rank"
    assert held <= 0.6 * total, f"ZeRO-1 rank holds {held:.0f} of {total} state elements (want ~1/2)"
    zero.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    return zero


def _check_zero1_checkpoint(mesh, parallel: ParallelLayout, model, zero, path: Path) -> None:
    """The checkpoint layer's DCP save/load round-trips a ZeRO-1 optimizer: each rank gets its own states."""
    from dhp.checkpoint.module_state import load_module_state, save_module_state

    save_module_state(path, model=model, optimizer=zero, extra=None)
    zparallel = ParallelLayout(**{**parallel.__dict__, "zero": 1})
    fresh = parallelize(
        "llm",
        build_llm(seed=7),
        mesh,
        layout=zparallel,
        activation_checkpointing=False,
        mixed_precision="fp32",
    )
    opt = build_optimizer(fresh, mesh, layout=zparallel, train=TRAIN)
    load_module_state(path, model=fresh, optimizer=opt)
    by_name = dict(fresh.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(local(p), local(by_name[name])), name
        if p in zero.state:
            assert torch.equal(zero.state[p]["exp_avg"], opt.state[by_name[name]]["exp_avg"]), name
    assert len(opt.state) == len(zero.state)


def _dp2_cases(rank: int, world: int, path: str) -> None:
    batch = llm_batch(seed=4, batch=4)
    ref_loss, ref_gin, ref_grads = _reference(batch, int((batch["labels"][:, 1:] != -100).sum()))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    parallel = ParallelLayout(dp=2)
    model, loss, gin, comm = _dp_replica(mesh, parallel, batch, rank, 2)
    assert_rel_close(loss, ref_loss, rtol=RTOL, name="dp=2 loss")
    ref_half = split_llm({**batch, "image_embeds": ref_gin}, rank, 2)["image_embeds"]
    assert_rel_close(gin, ref_half, rtol=RTOL, name="dp=2 d/d embeds")
    assert_grads_match(full_grads(model), ref_grads, rtol=RTOL, tag="dp=2")
    assert abs(grad_norm_sq(model, mesh) - ref_norm_sq(ref_grads)) <= RTOL * ref_norm_sq(ref_grads)
    # the byte counter saw exactly one fp32 copy of every gradient in finalize_grads' all-reduce
    nbytes = 4 * sum(p.numel() for p in model.parameters())
    assert comm["llm/all_reduce"].payload_bytes == nbytes, comm
    assert comm["llm/all_reduce"].wire_bytes == pytest.approx(nbytes * 2 * (2 - 1) / 2)
    zero = _check_zero1(mesh, parallel, model)
    _check_zero1_checkpoint(mesh, parallel, model, zero, Path(path))


def test_dp2_halves_equal_whole_batch_and_zero1(tmp_path: Path) -> None:
    spawn(_dp2_cases, 2, str(tmp_path / "ckpt"))


def _dp_tp_cases(rank: int, world: int) -> None:
    batch = llm_batch(seed=5, batch=4)
    ref_loss, ref_gin, ref_grads = _reference(batch, int((batch["labels"][:, 1:] != -100).sum()))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallel = ParallelLayout(dp=2, tp=2)
    dp_rank = mesh["dp"].get_local_rank()
    model, loss, gin, comm = _dp_replica(mesh, parallel, batch, dp_rank, 2)
    assert local(model.lm_head.weight).shape[0] == 1024 // 2
    assert_rel_close(loss, ref_loss, rtol=RTOL, name="dp x tp loss")
    ref_half = split_llm({**batch, "image_embeds": ref_gin}, dp_rank, 2)["image_embeds"]
    assert_rel_close(gin, ref_half, rtol=RTOL, name="dp x tp d/d embeds")
    assert_grads_match(full_grads(model), ref_grads, rtol=RTOL, tag="dp x tp")
    assert abs(grad_norm_sq(model, mesh) - ref_norm_sq(ref_grads)) <= RTOL * ref_norm_sq(ref_grads)
    # over dp each rank all-reduces its TP shard of every gradient: 4 bytes x local elements
    assert comm["llm/all_reduce"].payload_bytes == 4 * sum(local(p).numel() for p in model.parameters()), (
        comm,
        4 * sum(local(p).numel() for p in model.parameters()),
    )
    _check_zero1(mesh, parallel, model)


@pytest.mark.slow
def test_dp2_x_tp2_matches_single_process_and_zero1() -> None:
    spawn(_dp_tp_cases, 4)
