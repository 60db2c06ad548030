"""dhp.parallel.precision on small modules: the policy table, the unit cast's contract (bf16 copies only
while a unit runs, gradients back into the fp32 parameters, restored when the forward raises, a tied
parameter cast once), and the refusals (parameters stored in another dtype, a GPU without bf16)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dhp.config.constants import MIXED_PRECISIONS
from dhp.errors import ConfigError, PlanError
from dhp.parallel.fsdp import MIXED_PRECISION
from dhp.parallel.precision import (
    PRECISIONS,
    apply_compute_cast,
    cast_parameters_,
    check_device_computes,
    check_parameter_dtypes,
    precision_of,
)

pytestmark = pytest.mark.unit


class _Net(nn.Module):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.fail, self.seen = fail, []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        if self.fail:
            raise ValueError("boom")
        self.seen.append(self.head.weight.dtype)
        return x @ self.head.weight.t()


def test_one_table_for_every_policy_and_fsdp() -> None:
    assert set(PRECISIONS) == set(MIXED_PRECISIONS) == set(MIXED_PRECISION)
    assert MIXED_PRECISION["fp32"] is None
    mp = MIXED_PRECISION["bf16_master_fp32"]
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert precision_of("bf16_master_fp32").casts and not precision_of("bf16").casts
    with pytest.raises(PlanError, match="fp16"):
        precision_of("fp16")


def test_unit_cast_computes_bf16_and_accumulates_fp32_grads() -> None:
    torch.manual_seed(0)
    net = _Net()
    apply_compute_cast(net, list(net.blocks), dtype=torch.bfloat16)
    for block in net.blocks:  # a pre-hook after the cast's: what the block computes with
        block.register_forward_pre_hook(lambda m, args: net.seen.append(m.weight.dtype))
    out = net(torch.tensor([[1, 2, 3]]))
    assert out.dtype == torch.bfloat16 and net.seen == [torch.bfloat16] * 3  # blocks and the tied head
    assert all(isinstance(p, nn.Parameter) and p.dtype == torch.float32 for p in net.parameters())
    assert net.head.weight is net.embed.weight  # restored, still tied
    out.float().sum().backward()
    out2 = net(torch.tensor([[1, 2, 3]]))  # a second micro-batch accumulates into the fp32 grads
    out2.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in net.parameters())


def test_unit_cast_restores_the_parameters_when_the_forward_raises() -> None:
    net = _Net(fail=True)
    params = dict(net.named_parameters())
    apply_compute_cast(net, list(net.blocks), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="boom"):
        net(torch.tensor([[1]]))
    assert dict(net.named_parameters()) == params
    assert all(type(p) is nn.Parameter for p in net.parameters())


def test_a_module_stored_in_another_dtype_is_refused() -> None:
    net = _Net()
    with pytest.raises(PlanError, match=r"stores parameters in torch\.bfloat16"):
        check_parameter_dtypes(net, precision_of("bf16"), module_name="llm")
    check_parameter_dtypes(cast_parameters_(net, torch.bfloat16), precision_of("bf16"), module_name="llm")
    assert net.head.weight is net.embed.weight  # the same Parameter objects, cast in place


def test_a_gpu_without_bf16_refuses_a_bf16_policy(monkeypatch) -> None:
    # no GPU here: the query the rank makes is answered as an sm_70 GPU would answer it
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    gpu = torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=r"modules\.llm\.mixed_precision.*compute capability >= 8\.0"):
        check_device_computes(precision_of("bf16_master_fp32"), gpu, module_name="llm")
    check_device_computes(precision_of("fp32"), gpu, module_name="llm")
    check_device_computes(precision_of("bf16"), torch.device("cpu"), module_name="llm")
