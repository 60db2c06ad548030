"""``train.optimizer.impl``: fused, foreach and for_loop AdamW give the same parameters, on gloo.

Three steps on identical gradients, plain (one rank's full model), ZeRO-1 (dp=2) and FSDP2 (fsdp=2,
DTensor parameters), every implementation built by ``build_optimizer``. The three evaluate the same
update in a different order of fp32 operations, so they differ only by fp32 rounding: with lr 1e-2
and parameters up to ~1, fused differs from for_loop by at most 1.5e-8 after 3 steps (~1 ulp at 0.1;
foreach equals for_loop bit for bit on CPU); the bound below, 1e-6 absolute, stays far below one
step's change of a parameter (~1e-2).
"""

from __future__ import annotations

import pytest
import torch
from parallel_harness import build_llm, spawn
from torch.distributed.device_mesh import init_device_mesh

from dhp.config.constants import OPTIMIZER_IMPLS
from dhp.config.schema import OptimizerConfig, TrainConfig
from dhp.layout import ParallelLayout
from dhp.parallel import build_optimizer, parallelize
from dhp.parallel.dp import Zero1AdamW
from dhp.parallel.state import full_param_dict

ATOL = 1e-6  # fp32 rounding of three AdamW steps (module docstring)
STEPS = 3

pytestmark = pytest.mark.parity


def _train(impl: str) -> TrainConfig:
    return TrainConfig(lr=1e-2, weight_decay=0.1, optimizer=OptimizerConfig(impl=impl))


def _grads(model: torch.nn.Module, step: int) -> None:
    """The same pseudo-random full gradient on every rank and implementation (a DTensor gets its shard)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=gen)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full


def _run(mesh, parallel: ParallelLayout, impl: str) -> dict[str, torch.Tensor]:
    model = build_llm()
    if parallel.fsdp > 1:
        model = parallelize(
            "llm", model, mesh, layout=parallel, activation_checkpointing=False, mixed_precision="fp32"
        )
    opt = build_optimizer(model, mesh, layout=parallel, train=_train(impl))
    assert isinstance(opt, Zero1AdamW) == (parallel.zero == 1)
    want = {"fused": True, "foreach": True, "for_loop": False}[impl]
    assert opt.defaults["fused" if impl == "fused" else "foreach"] is want, opt.defaults
    for step in range(STEPS):
        _grads(model, step)
        opt.step()
        opt.zero_grad()
    return full_param_dict(model)


def _cases(rank: int, world: int) -> None:
    start = full_param_dict(build_llm())
    for axis, parallel in (
        ("dp", ParallelLayout()),
        ("dp", ParallelLayout(dp=2, zero=1)),
        ("fsdp", ParallelLayout(fsdp=2)),
    ):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
        runs = {impl: _run(mesh, parallel, impl) for impl in OPTIMIZER_IMPLS}
        ref = runs["for_loop"]
        moved = max(float((ref[k] - start[k]).abs().max()) for k in ref)
        assert moved > 1e-3, f"{parallel}: the parameters did not move ({moved})"
        for impl, got in runs.items():
            for k in ref:
                diff = float((got[k] - ref[k]).abs().max())
                assert diff <= ATOL, f"{parallel} {impl}: {k} differs from for_loop by {diff:.2e}"


def test_fused_foreach_for_loop_agree_plain_zero1_fsdp() -> None:
    spawn(_cases, 2)
