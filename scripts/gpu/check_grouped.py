"""The grouped-GEMM expert path (``torch._grouped_mm``, what EP runs in bf16 on CUDA) against the
per-expert loop, forward and backward, with empty experts (first, middle, last): output, the rows'
gradient and both expert weights' gradients; an empty expert's weight gradients must be exactly zero
(some GPUs' grouped backward is reported to leave garbage in empty groups). bf16 on CUDA; fp32 on the
CPU in dry mode. Sizes: 8 experts, hidden 1024, intermediate 512 (tiny in dry mode)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from check_helpers import Ctx

from dhp.parallel.ep import _grouped_path, _loop_path, grouped_mm_used


def _run(path, x, gate_up, down, counts):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, gate_up, down)]
    out = path(leaves[0], counts, leaves[1], leaves[2], F.silu)
    w = torch.linspace(-1, 1, out.numel(), device=x.device, dtype=out.dtype).view_as(out)
    (out * w).sum().backward()  # a dense incoming gradient, as inside EP
    return out.detach(), *(t.grad for t in leaves)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return (a - b).norm().item() / max(b.norm().item(), 1e-12)


def check_grouped(ctx: Ctx, args) -> str:
    dtype, rtol = (torch.bfloat16, 2e-2) if ctx.cuda else (torch.float32, 1e-5)
    h, inter = (1024, 512) if ctx.cuda else (16, 8)
    counts_list = [0, 300, 0, 512, 77, 0, 1, 256] if ctx.cuda else [0, 3, 0, 5, 2, 0, 1, 4]
    e = len(counts_list)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(counts_list), h, generator=g).to(ctx.device, dtype)
    gate_up = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(ctx.device, dtype)
    down = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(ctx.device, dtype)
    counts = torch.tensor(counts_list, device=ctx.device)
    ctx.fig("grouped_mm_used", bool(grouped_mm_used(x, gate_up, down)))
    want = _run(_loop_path, x, gate_up, down, counts)
    got = _run(_grouped_path, x, gate_up, down, counts)
    worst = 0.0
    for name, a, b in zip(("output", "d_rows", "d_gate_up", "d_down"), got, want, strict=True):
        r = _rel(a, b)
        worst = max(worst, r)
        ctx.fig(f"rel_err.{name}", r)
    empty = [i for i, c in enumerate(counts_list) if c == 0]
    leak = max(float(t[empty].abs().max()) for t in (got[2], got[3]))
    ctx.fig("empty_expert_grad_max_abs", leak)
    if leak != 0.0:
        ctx.note(f"empty experts {empty} got non-zero weight gradients (max |g| {leak:.3e})")
        return "fail"
    if worst > rtol:
        ctx.note(f"grouped vs loop relative error {worst:.2e} > {rtol:.0e}")
        return "fail"
    return "pass"
