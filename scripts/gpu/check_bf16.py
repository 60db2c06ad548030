"""bf16 vs fp32 forward/backward of VisionModule + LLMModule, tiny and (on CUDA) 7B widths."""

from __future__ import annotations

import copy
import math

import torch
from check_helpers import Ctx, llm_kwargs, model_cfg, rel, sub_result, vl_batch

# ---------------------------------------------------------------------------------------------
# 2. bf16 vs fp32 forward/backward


def _fwd_bwd(vision, llm, b) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
    embeds = vision(b["pixel_values"], b["image_grid_thw"])["image_embeds"]
    out = llm(**llm_kwargs(b), image_embeds=embeds)
    loss = out.loss_sum / out.num_tokens
    loss.backward()
    grads = {f"vision.{n}": p.grad for n, p in vision.named_parameters()}
    grads |= {f"llm.{n}": p.grad for n, p in llm.named_parameters()}
    return float(loss.detach()), embeds.detach(), grads


def _bf16_case(ctx: Ctx, label: str, mc, grid, text) -> bool:
    from dhp.models import get_family
    from dhp.models.testing import relative_error

    fam = get_family("qwen2_5_vl")
    cfg = fam.hf_config(mc)
    torch.manual_seed(0)
    v32 = fam.build_module("vision", cfg, device=ctx.device, dtype=torch.float32)
    l32 = fam.build_module("llm", cfg, device=ctx.device, dtype=torch.float32)
    nparams = sum(p.numel() for m in (v32, l32) for p in m.parameters())
    ctx.fig(f"{label}.params_m", round(nparams / 1e6, 1))
    b = vl_batch(cfg, grid=grid, text=text, device=ctx.device)
    ctx.fig(f"{label}.tokens", int(b["input_ids"].numel()))
    loss32, emb32, g32 = _fwd_bwd(v32, l32, b)
    norm32 = {k: float(g.float().norm()) for k, g in g32.items() if g is not None}
    del g32
    v16, l16 = copy.deepcopy(v32).to(torch.bfloat16), copy.deepcopy(l32).to(torch.bfloat16)
    v16.zero_grad(set_to_none=True)
    l16.zero_grad(set_to_none=True)
    del v32, l32
    if ctx.cuda:
        torch.cuda.empty_cache()
    loss16, emb16, g16 = _fwd_bwd(v16, l16, b)
    missing = [k for k, g in g16.items() if g is None]
    nonfinite = [k for k, g in g16.items() if g is not None and not torch.isfinite(g).all()]
    norm16 = {k: float(g.float().norm()) for k, g in g16.items() if g is not None}
    total32 = math.sqrt(sum(v * v for v in norm32.values()))
    total16 = math.sqrt(sum(v * v for v in norm16.values()))
    ctx.fig(f"{label}.loss_fp32", loss32)
    ctx.fig(f"{label}.loss_bf16", loss16)
    ctx.fig(f"{label}.loss_rel_diff", rel(loss16, loss32))
    ctx.fig(f"{label}.embeds_rel_err", relative_error(emb16.float(), emb32.float()))
    ctx.fig(f"{label}.grad_norm_rel_diff", rel(total16, total32))
    ctx.fig(f"{label}.grads_missing", missing[:5])
    ctx.fig(f"{label}.grads_nonfinite", nonfinite[:5])
    ok = not nonfinite and not missing and rel(loss16, loss32) < 2e-2 and rel(total16, total32) < 0.1
    del v16, l16, g16
    if ctx.cuda:
        torch.cuda.empty_cache()
    return ok


def check_bf16(ctx: Ctx, args) -> str:
    oks = [
        sub_result(ctx, "tiny", lambda: _bf16_case(ctx, "tiny", model_cfg("tiny"), (8, 8), 32)),
    ]
    if ctx.cuda:
        mc = model_cfg("7b", llm_layers=2, vision_depth=2)
        oks.append(sub_result(ctx, "mid", lambda: _bf16_case(ctx, "mid_7b_widths_2l", mc, (32, 32), 512)))
    else:
        ctx.note("mid-size (7B widths, 2 layers) skipped: no CUDA; tiny ran on the CPU")
    return "pass" if all(oks) else "fail"
