"""MFU: one training step (fwd+bwd+AdamW) of encoder + LLM on one GPU through dhp's code."""

from __future__ import annotations

import dataclasses
import math
import time

import torch
from check_helpers import ROOT, Ctx, init_world, llm_kwargs, model_cfg, vl_batch

# ---------------------------------------------------------------------------------------------
# 6. MFU: one training step of encoder + LLM on one GPU through dhp's code


def check_mfu(ctx: Ctx, args) -> str:
    import yaml
    from torch.distributed.device_mesh import init_device_mesh

    from dhp import parallel as par
    from dhp.config.schema import TrainConfig
    from dhp.layout import ParallelLayout
    from dhp.metrics import model_flops_per_step
    from dhp.models import get_family

    init_world(ctx)
    mesh = init_device_mesh(ctx.device.type, (1,), mesh_dim_names=("dp",))
    if ctx.cuda or args.widths == "7b":
        mc = model_cfg("7b", dtype="bfloat16", llm_layers=args.llm_layers, vision_depth=args.vision_depth)
        grid, text, steps, warm = (64, 64), 2048, 5, 2
    else:
        mc = model_cfg("tiny", dtype="bfloat16")
        grid, text, steps, warm = (16, 16), 128, 2, 1
    if args.grid:
        grid, text, steps, warm = (args.grid, args.grid), args.text, 2, 1
    if not ctx.cuda:
        ctx.note("no CUDA: run on the CPU (harness only; the MFU figure is meaningless)")
    dtype = torch.bfloat16
    fam = get_family("qwen2_5_vl")
    cfg = fam.hf_config(mc)
    ctx.fig("model", f"{mc.name}: vision depth {mc.vision.depth}, llm layers {mc.llm.num_layers}, bf16, sdpa")
    torch.manual_seed(0)
    train = TrainConfig()
    mods, opts = {}, {}
    for name in ("vision", "llm"):
        m = fam.build_module(name, cfg, device=ctx.device, dtype=dtype)
        mods[name] = par.parallelize(
            name, m, mesh, layout=ParallelLayout(), activation_checkpointing=False, mixed_precision="bf16"
        )
        opts[name] = par.build_optimizer(mods[name], mesh, layout=ParallelLayout(), train=train)
        ctx.fig(f"{name}.params_m", round(sum(p.numel() for p in m.parameters()) / 1e6, 1))
    b = vl_batch(cfg, grid=grid, text=text, device=torch.device("cpu"))
    shard = fam.shard_inputs(
        "vision", cfg, pixel_values=b["pixel_values"], image_grid_thw=b["image_grid_thw"], sp_size=1
    )[0]
    shard = dataclasses.replace(
        shard,
        **{
            f.name: getattr(shard, f.name).to(ctx.device)
            for f in dataclasses.fields(shard)
            if isinstance(getattr(shard, f.name), torch.Tensor)
        },
    )
    kw = {k: (v.to(ctx.device) if isinstance(v, torch.Tensor) else v) for k, v in llm_kwargs(b).items()}
    seq, patches = int(b["input_ids"].shape[1]), int(b["pixel_values"].shape[0])
    n_label = int((b["labels"][:, 1:] != -100).sum())
    ctx.fig("image_patches", patches)
    ctx.fig("seq_len", seq)
    phases = {"vision_fwd": 0.0, "llm_fwd_bwd": 0.0, "vision_bwd": 0.0, "optim": 0.0}
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()

    def step(record: bool) -> float:
        t = [time.perf_counter()]

        def mark():
            ctx.sync()
            t.append(time.perf_counter())

        out = mods["vision"](**shard.forward_kwargs())["image_embeds"]
        mark()
        embeds = out.detach().requires_grad_(True)
        res = mods["llm"](**kw, image_embeds=embeds)
        (res.loss_sum / n_label).backward()
        mark()
        out.backward(embeds.grad)
        mark()
        sq = sum(float(par.grad_norm_sq(mods[n], mesh)) for n in mods)
        coef = min(1.0, train.grad_clip / (math.sqrt(sq) + 1e-6))
        for n in mods:
            if coef < 1.0:
                par.clip_grads_(mods[n], coef)
            opts[n].step()
            opts[n].zero_grad(set_to_none=True)
        mark()
        if record:
            for k, a, z in zip(phases, t, t[1:], strict=False):
                phases[k] += z - a
        return float(res.loss_sum.detach()) / n_label

    for _ in range(warm):
        step(False)
    t0 = time.perf_counter()
    losses = [step(True) for _ in range(steps)]
    step_s = (time.perf_counter() - t0) / steps
    flops = model_flops_per_step(
        mc, image_patches=[patches], seq_lens=[seq], frozen={"vision": False, "llm": False}
    )
    peak = yaml.safe_load((ROOT / "conf/cluster/h200_1x.yaml").read_text())["peak_bf16_tflops"]
    ctx.fig("step_s", step_s)
    for k, v in phases.items():
        ctx.fig(f"phase.{k}_s", v / steps)
    ctx.fig("loss_first_last", [losses[0], losses[-1]])
    ctx.fig("model_tflop_per_step", flops / 1e12)
    ctx.fig("achieved_tflops", flops / step_s / 1e12)
    ctx.fig("tokens_per_s_text", seq / step_s)
    ctx.fig("patches_per_s_vision", patches / step_s)
    ctx.fig("peak_tflops_h200_1x_profile", peak)
    ctx.fig("mfu", flops / step_s / (peak * 1e12))
    if ctx.cuda:
        ctx.fig("peak_mem_gib", torch.cuda.max_memory_allocated() / 2**30)
    import torch.distributed as dist

    dist.destroy_process_group()
    finite = all(math.isfinite(x) for x in losses)
    if not ctx.cuda:
        return "skipped: no CUDA" if finite else "fail"
    return "pass" if finite else "fail"
