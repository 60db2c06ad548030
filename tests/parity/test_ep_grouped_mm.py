"""The grouped-GEMM expert path (``torch._grouped_mm``) against the per-expert loop, forward AND backward.

Both run ``dhp.parallel.ep``'s own functions on the same rows, grouped by expert, with empty experts
(the first, a middle and the last, so offsets repeat at both ends). Compared: the output, the rows'
gradient and both expert weights' gradients (an empty expert's must be exactly zero on both paths).

CPU (fp32) runs the grouped kernel both ways in torch 2.13 when the incoming gradient is a dense
tensor, as it is inside EP (the output is re-indexed before the combine); a stride-0 gradient such as
``out.sum().backward()`` hands it raises "Invalid strides/sizes", so the loss here weights every
output element. CUDA (bf16, the path ``grouped_mm_used`` takes) runs too where present. Tolerances:
fp32 1e-5 relative (norm sense); bf16 2e-2 relative against the loop on the same bf16 operands.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dhp.parallel.ep import _grouped_path, _loop_path

pytestmark = pytest.mark.parity
COUNTS = [0, 3, 0, 5, 2, 0]  # experts 0, 2 and 5 get no rows
H, INTER = 16, 8  # row strides are multiples of 16 bytes, as the kernel needs


def _devices() -> list:
    cuda = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    return [("cpu", torch.float32, 1e-5)] + ([("cuda", torch.bfloat16, 2e-2)] if cuda else [])


def _run(path, x, gate_up, down):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, gate_up, down)]
    counts = torch.tensor(COUNTS, device=x.device)
    out = path(leaves[0], counts, leaves[1], leaves[2], F.silu)
    w = torch.linspace(-1, 1, out.numel(), device=x.device, dtype=out.dtype).view_as(out)
    (out * w).sum().backward()  # a dense incoming gradient (see the module docstring)
    return out.detach(), *(t.grad for t in leaves)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return (got - want).norm().item() / max(want.norm().item(), 1e-12)


@pytest.mark.parametrize(("device", "dtype", "rtol"), _devices(), ids=lambda v: str(v))
def test_grouped_mm_forward_and_backward_match_the_loop(device: str, dtype: torch.dtype, rtol: float):
    g = torch.Generator().manual_seed(3)
    e = len(COUNTS)
    x = torch.randn(sum(COUNTS), H, generator=g).to(device, dtype)
    gate_up = (torch.randn(e, 2 * INTER, H, generator=g) / H**0.5).to(device, dtype)
    down = (torch.randn(e, H, INTER, generator=g) / INTER**0.5).to(device, dtype)
    want = _run(_loop_path, x, gate_up, down)
    got = _run(_grouped_path, x, gate_up, down)
    for name, a, b in zip(
        ("output", "d/d rows", "d/d gate_up_proj", "d/d down_proj"), got, want, strict=True
    ):
        assert a.shape == b.shape, name
        assert _rel(a, b) <= rtol, f"{device} {name}: relative error {_rel(a, b):.2e} > {rtol:.0e}"
    empty = [i for i, c in enumerate(COUNTS) if c == 0]
    for name, grad in (("gate_up_proj", got[2]), ("down_proj", got[3])):
        assert not grad[empty].any(), f"{device}: an empty expert's {name} gradient is not zero"
