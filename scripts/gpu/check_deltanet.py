"""The Gated DeltaNet kernels (deltanet): which kernel dhp names for the GPU, and kernel vs torch reference.

On CUDA: ``dhp.ops.linear_attn.linear_attention_kernel("cuda")`` (fla-chunk when the ``[gpu]`` extra's
flash-linear-attention and causal-conv1d import). transformers' own ops run once on CUDA inputs (the
kernel when it imports) and once on CPU copies (its torch reference, by its dispatcher's rule), fp32:
the chunked gated delta rule's output, final state and input grads, and the causal conv1d's output,
as relative errors (norm sense); then the CUDA timing of the delta rule forward+backward (the kernel,
and the torch reference on the GPU where it can be reached). A torch fallback on CUDA is a fail: the
GPU extra is missing, and the run would be slow. Without CUDA the harness runs on tiny CPU sizes and
the check reports ``skipped: no CUDA``.
"""

from __future__ import annotations

import time

import torch
from check_helpers import Ctx

#: fp32 kernel vs fp32 torch reference (chunked, different summation order, TF32 inside the kernel)
RTOL = 2e-2


def _inputs(ctx: Ctx, *, seq: int, hk: int, hv: int, d: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, seq, hk, d, generator=g) for _ in range(2))
    v = torch.randn(1, seq, hv, d, generator=g)
    decay = -torch.nn.functional.softplus(torch.randn(1, seq, hv, generator=g))  # log decay <= 0
    beta = torch.rand(1, seq, hv, generator=g)
    return {"query": q, "key": k, "value": v, "g": decay, "beta": beta}


def _delta_rule(fn, x: dict[str, torch.Tensor], device: torch.device, up: torch.Tensor):
    """Output, final state and input grads of transformers' delta-rule op on ``device`` (fp32)."""
    leaves = {n: t.to(device).requires_grad_(n in ("query", "key", "value")) for n, t in x.items()}
    out, state = fn(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out.backward(up.to(device))
    grads = [leaves[n].grad.cpu() for n in ("query", "key", "value")]
    return out.detach().cpu(), state.detach().cpu(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _torch_reference(op):
    """transformers' torch function behind its kernel dispatcher (to time the fallback on the GPU), or
    None when the dispatcher's layout is not the one known here."""
    seen, todo = set(), [op, getattr(type(op), "forward", None)]
    while todo:
        f = todo.pop()
        code = getattr(f, "__code__", None)
        if f is None or id(f) in seen or code is None:
            continue
        seen.add(id(f))
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in f.__closure__ or ()), strict=True))
        if callable(cells.get("torch_function")):
            return cells["torch_function"]
        todo += [c for c in cells.values() if callable(c)]
    return None


def _time(ctx: Ctx, fn, x, up, reps: int) -> float:
    for _ in range(2):
        _delta_rule(fn, x, ctx.device, up)
    ctx.sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        _delta_rule(fn, x, ctx.device, up)
    ctx.sync()
    return (time.perf_counter() - t0) / reps * 1e3


def check_deltanet(ctx: Ctx, args) -> str:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from dhp.ops.linear_attn import is_slow_fallback, kernel_note, linear_attention_kernel

    device_type = "cuda" if ctx.cuda else "cpu"
    kernel = linear_attention_kernel(device_type)
    ctx.fig("kernel", kernel_note(device_type, kernel))
    seq, hk, hv, d = (2048, 4, 8, 128) if ctx.cuda else (96, 2, 4, 16)
    x = _inputs(ctx, seq=seq, hk=hk, hv=hv, d=d)
    up = torch.randn(1, seq, hv, d, generator=torch.Generator().manual_seed(1))
    cpu = torch.device("cpu")
    ref_out, ref_state, ref_grads = _delta_rule(hf.torch_chunk_gated_delta_rule, x, cpu, up)
    ctx.fig("shape", f"B=1 S={seq} Hk={hk} Hv={hv} d={d} fp32")
    out, state, grads = _delta_rule(hf.torch_chunk_gated_delta_rule, x, ctx.device, up)
    errs = {
        "delta_rule.out": _rel(out, ref_out),
        "delta_rule.state": _rel(state, ref_state),
        **{f"delta_rule.grad_{n}": _rel(g, r) for n, g, r in zip("qkv", grads, ref_grads, strict=True)},
    }
    w = torch.randn(hk * 2 * d + hv * d, 4, generator=torch.Generator().manual_seed(2))
    h = torch.randn(1, w.shape[0], seq, generator=torch.Generator().manual_seed(3))
    conv_ref = hf.causal_conv1d_fn(h, w, None, activation="silu")
    conv = hf.causal_conv1d_fn(h.to(ctx.device), w.to(ctx.device), None, activation="silu").cpu()
    errs["conv1d.out"] = _rel(conv, conv_ref)
    for k, v in errs.items():
        ctx.fig(f"rel_err.{k}", v)
    ok = all(v <= RTOL for v in errs.values())
    reps = 5 if ctx.cuda else 1
    ctx.fig("ms_fwd_bwd.dispatched", _time(ctx, hf.torch_chunk_gated_delta_rule, x, up, reps))
    reference = _torch_reference(hf.torch_chunk_gated_delta_rule)
    ctx.fig("torch_reference_reachable", reference is not None)
    if reference is not None and not is_slow_fallback(device_type, kernel):
        ctx.fig("ms_fwd_bwd.torch_reference", _time(ctx, reference, x, up, reps))
    if not ctx.cuda:
        ctx.note("harness only: both sides ran transformers' torch reference on CPU")
        return "skipped: no CUDA"
    if is_slow_fallback(device_type, kernel):
        ctx.note(f"{kernel} on CUDA: the [gpu] extra's kernels are not importable; Gated DeltaNet runs slow")
        return "fail"
    return "pass" if ok else "fail"
