"""``parallelize`` as the one entry point: vision TP through it (part 1's plan), and every inconsistent
or unsupported plan refused with a PlanError before the module is touched."""

from __future__ import annotations

import pytest
import torch
from parallel_harness import assert_grads_match, build_llm, build_vision, full_grads, spawn, vision_batch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dhp.errors import PlanError
from dhp.layout import ParallelLayout
from dhp.parallel import parallelize

# fp32 on CPU, reduction order only: <= 1e-5 relative (norm sense) per gradient.
RTOL = 1e-5

pytestmark = pytest.mark.parity


def _refusals(mesh) -> None:
    cases = [
        ("llm", ParallelLayout(tp=2, sp=2), "mesh degrees"),  # the mesh has no sp axis
        ("llm", ParallelLayout(fsdp=2), "mesh degrees"),  # the mesh's axis is tp, not fsdp
    ]
    for name, parallel, msg in cases:
        model = build_llm()
        with pytest.raises(PlanError, match=msg):
            parallelize(
                name, model, mesh, layout=parallel, activation_checkpointing=False, mixed_precision="fp32"
            )
        assert not isinstance(model.lm_head.weight, DTensor), "a refused plan must leave the module untouched"
    with pytest.raises(PlanError, match="has no parallel_plan"):  # not built by a model family
        parallelize("llm", torch.nn.Linear(2, 2), mesh, layout=ParallelLayout(tp=2),
                    activation_checkpointing=False, mixed_precision="fp32")  # fmt: skip
    with pytest.raises(PlanError, match="mixed_precision = 'fp16'"):
        parallelize(
            "llm",
            build_llm(),
            mesh,
            layout=ParallelLayout(tp=2),
            activation_checkpointing=False,
            mixed_precision="fp16",
        )
    sp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("sp",))
    with pytest.raises(PlanError, match="does not support sp"):
        parallelize(
            "llm",
            build_llm(),
            sp_mesh,
            layout=ParallelLayout(sp=2),
            activation_checkpointing=False,
            mixed_precision="fp32",
        )


def _cases(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    _refusals(mesh)
    batch = vision_batch(11, [(1, 8, 8), (1, 4, 8)])
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(12))
    ref = build_vision()
    (ref(**batch) * w).sum().backward()
    model = parallelize(
        "vision",
        build_vision(),
        mesh,
        layout=ParallelLayout(tp=world),
        activation_checkpointing=True,
        mixed_precision="fp32",
    )
    assert isinstance(model.visual.blocks[0].attn.qkv.weight, DTensor)
    (model(**batch) * w).sum().backward()
    assert_grads_match(
        full_grads(model), {k: p.grad for k, p in ref.named_parameters()}, rtol=RTOL, tag="vision tp+ac"
    )


def test_parallelize_vision_tp_and_refusals() -> None:
    spawn(_cases, 2)
