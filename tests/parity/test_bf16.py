"""FSDP2 mixed precision (bf16 parameters/compute, fp32 master weights and fp32 gradient reduce) on the
LLM, against the fp32 single-process module: the documented looser tolerance."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_harness import assert_rel_close, build_llm, full_grads, llm_batch, llm_step, spawn, split_llm
from torch.distributed.device_mesh import init_device_mesh

from dhp.layout import ParallelLayout
from dhp.parallel import finalize_grads, parallelize

# bf16 keeps 8 mantissa bits (unit roundoff 2^-9 ~ 2e-3) on every weight, activation and matmul of a
# 2-layer model; measured relative errors here: 4.9e-5 (loss), worst gradient 1.3e-2 (norm sense).
# Bound: loss <= 1e-3, every gradient <= 5e-2 relative (norm sense); fp32 master params stay fp32.
LOSS_RTOL = 1e-3
GRAD_RTOL = 5e-2

pytestmark = pytest.mark.parity


def _bf16_case(rank: int, world: int) -> None:
    batch = llm_batch(seed=6, batch=4)
    num_tokens = int((batch["labels"][:, 1:] != -100).sum())
    ref = build_llm()
    ref_loss, ref_gin = llm_step(ref, batch, num_tokens)
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    parallel = ParallelLayout(fsdp=world)
    model = parallelize(
        "llm",
        build_llm(),
        mesh,
        layout=parallel,
        activation_checkpointing=False,
        mixed_precision="bf16_master_fp32",
    )
    loss, gin = llm_step(model, split_llm(batch, rank, world), num_tokens)
    finalize_grads(model, mesh, layout=parallel)
    dist.all_reduce(loss)
    assert all(p.dtype == torch.float32 for p in model.parameters()), "master params must stay fp32"
    assert all(p.grad.dtype == torch.float32 for p in model.parameters()), "reduced grads must be fp32"
    assert_rel_close(loss, ref_loss, rtol=LOSS_RTOL, name="bf16 loss")
    want_gin = split_llm({**batch, "image_embeds": ref_gin}, rank, world)["image_embeds"]
    assert_rel_close(gin.float(), want_gin, rtol=GRAD_RTOL, name="bf16 d/d embeds")
    got = full_grads(model)
    worst = max(((got[k] - g).norm() / g.norm()).item() for k, g in ref_grads.items())
    if rank == 0:
        print(
            f"bf16 loss rel err {abs(loss - ref_loss).item() / ref_loss.item():.2e}, worst grad rel err {worst:.2e}"
        )
    for k, g in ref_grads.items():
        assert_rel_close(got[k], g, rtol=GRAD_RTOL, name=f"bf16 grad {k}")
    # and bf16 really ran: the result is not bit-identical to fp32
    assert worst > 1e-5, "bf16 policy had no effect"


def test_fsdp2_bf16_mixed_precision_within_documented_tolerance() -> None:
    spawn(_bf16_case, 2)
