"""NCCL: a world of one rank through dhp's parallel code (collectives, TP, Ulysses SP, DP all-reduce,
ZeRO-1); two ranks on one GPU attempted."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from check_helpers import Ctx, free_port, init_world, llm_kwargs, model_cfg, rel, sub_result, tail, vl_batch

ENTRY = Path(__file__).with_name("checks.py")  # runs each rank as ``checks.py _nccl2_rank``

# ---------------------------------------------------------------------------------------------
# 3. NCCL: a world of one rank through dhp's parallel code; 2 ranks on one GPU attempted


def _tp1(ctx: Ctx) -> bool:
    from torch.distributed.device_mesh import init_device_mesh

    from dhp.models import get_family
    from dhp.parallel import CommCounter, apply_tp, full_grad_dict

    fam = get_family("qwen2_5_vl")
    cfg = fam.hf_config(model_cfg("tiny"))
    torch.manual_seed(0)
    ref = fam.build_module("llm", cfg, device=ctx.device, dtype=torch.float32)
    tp = copy.deepcopy(ref)
    mesh = init_device_mesh(ctx.device.type, (1,), mesh_dim_names=("tp",))
    apply_tp(tp, mesh)  # the family plan attached at build
    b = vl_batch(cfg, grid=(8, 8), text=32, device=ctx.device)
    emb = torch.randn(16, cfg.text_config.hidden_size, device=ctx.device, generator=None)
    out_ref = ref(**llm_kwargs(b), image_embeds=emb)
    out_ref.loss_sum.backward()
    counter = CommCounter("llm")
    with counter:
        out_tp = tp(**llm_kwargs(b), image_embeds=emb)
        out_tp.loss_sum.backward()
    stats = counter.step()
    ctx.fig("tp1.collectives", {k: v.calls for k, v in stats.items()})
    lt, lr = float(out_tp.loss_sum.detach()), float(out_ref.loss_sum.detach())
    ctx.fig("tp1.loss_rel_diff", rel(lt, lr))
    got = full_grad_dict(tp)
    worst = max(float((got[n].to(p.grad.device) - p.grad).abs().max()) for n, p in ref.named_parameters())
    ctx.fig("tp1.grad_max_abs_diff", worst)
    return rel(lt, lr) < 1e-5 and worst < 1e-4


def _sp1(ctx: Ctx) -> bool:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dhp.models import get_family
    from dhp.parallel import UlyssesSpec, apply_ulysses_sp, reduce_sp_grads

    fam = get_family("qwen2_5_vl")
    mc = model_cfg("tiny")
    cfg = fam.hf_config(mc)
    torch.manual_seed(0)
    ref = fam.build_module("vision", cfg, device=ctx.device, dtype=torch.float32)
    sp = copy.deepcopy(ref)
    mesh = init_device_mesh(ctx.device.type, (1,), mesh_dim_names=("sp",))
    apply_ulysses_sp(sp, mesh, UlyssesSpec(mesh_dim="sp"))
    b = vl_batch(cfg, grid=(16, 16), text=8, device=torch.device("cpu"))
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
    out = sp(**shard.forward_kwargs())["image_embeds"]
    want = ref(b["pixel_values"].to(ctx.device), b["image_grid_thw"].to(ctx.device))["image_embeds"]
    err = float((out - want).abs().max().detach())
    out.sum().backward()
    reduce_sp_grads(sp, dist.group.WORLD)
    ctx.fig("sp1.out_max_abs_diff", err)
    return err < 1e-5


def _zero1(ctx: Ctx) -> bool:
    """dhp's DP gradient all-reduce and ZeRO-1 AdamW over the world of one (FSDP refuses degree 1)."""
    import torch.distributed as dist

    from dhp.models import get_family
    from dhp.parallel import Zero1AdamW, allreduce_grads_

    fam = get_family("qwen2_5_vl")
    cfg = fam.hf_config(model_cfg("tiny"))
    torch.manual_seed(0)
    ref = fam.build_module("llm", cfg, device=ctx.device, dtype=torch.float32)
    sh = copy.deepcopy(ref)
    b = vl_batch(cfg, grid=(8, 8), text=32, device=ctx.device)
    emb = torch.randn(16, cfg.text_config.hidden_size, device=ctx.device)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_sh = Zero1AdamW(list(sh.parameters()), dp_group=dist.group.WORLD, lr=1e-3)
    for m, opt in ((ref, opt_ref), (sh, opt_sh)):
        m(**llm_kwargs(b), image_embeds=emb).loss_sum.backward()
        if m is sh:
            allreduce_grads_([p for p in sh.parameters() if p.requires_grad], dist.group.WORLD)
        opt.step()
        opt.zero_grad(set_to_none=True)
    got = dict(sh.named_parameters())
    worst = max(float((got[n] - p).detach().abs().max()) for n, p in ref.named_parameters())
    ctx.fig("zero1.param_max_abs_diff_after_step", worst)
    return worst < 1e-5


def _collectives(ctx: Ctx) -> bool:
    import torch.distributed as dist

    n = (64 << 20) // 4 if ctx.cuda else 1 << 16
    x = torch.arange(n, device=ctx.device, dtype=torch.float32)
    y = x.clone()
    dist.all_reduce(y)
    g = torch.empty_like(x)
    dist.all_gather_into_tensor(g, x)
    r = torch.empty_like(x)
    dist.reduce_scatter_tensor(r, x)
    a = torch.empty_like(x)
    dist.all_to_all_single(a, x)
    dist.broadcast(y, src=0)
    ctx.sync()
    ok = all(torch.equal(t, x) for t in (y, g, r, a))
    t0 = time.perf_counter()
    for _ in range(10):
        dist.all_reduce(y)
    ctx.sync()
    ctx.fig(
        "world1.all_reduce_64MiB_ms" if ctx.cuda else "world1.all_reduce_ms", (time.perf_counter() - t0) * 100
    )
    return ok


def _two_ranks_one_gpu(ctx: Ctx, args) -> None:
    """Two NCCL ranks on cuda:0: recorded as it happens (NCCL normally refuses a duplicate GPU)."""
    port = free_port()
    env = dict(os.environ, NCCL_DEBUG="WARN", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(ENTRY), "_nccl2_rank", "--port", str(port)]
    if args.cpu:
        cmd.append("--cpu")
    procs = [
        subprocess.Popen([*cmd, "--rank", str(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for r in range(2)
    ]
    outs, rcs = [], []
    deadline = time.monotonic() + args.nccl2_timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += b"\n[killed after timeout]"
        outs.append(out.decode(errors="replace"))
        rcs.append(p.returncode)
    text = "\n".join(outs)
    if all(rc == 0 for rc in rcs) and "ALLREDUCE_OK" in text:
        verdict = "ran: all_reduce of 2 ranks succeeded" + (" on one GPU" if ctx.cuda else " (gloo dry run)")
    elif "uplicate GPU" in text:
        verdict = "refused by NCCL: duplicate GPU (expected on a 1-GPU machine)"
    elif "[killed after timeout]" in text:
        verdict = "hung until the timeout"
    else:
        verdict = "failed (see nccl2.output)"
    ctx.fig("nccl2.backend", "gloo (dry)" if args.cpu or not ctx.cuda else "nccl")
    ctx.fig("nccl2.return_codes", rcs)
    ctx.fig("nccl2.verdict", verdict)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    key = [ln for ln in lines if any(w in ln for w in ("rror", "uplicate", "ALLREDUCE", "WARN", "killed"))]
    ctx.fig("nccl2.output", tail("\n".join(key[-12:] or lines[-12:]), 2000))


def nccl2_rank(args) -> int:
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not args.cpu
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    kw = {"device_id": dev} if cuda else {}
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=2,
        timeout=__import__("datetime").timedelta(seconds=max(10, args.nccl2_timeout - 10)),
        **kw,
    )
    t = torch.full((1024,), float(args.rank + 1), device=dev)
    dist.all_reduce(t)
    if cuda:
        torch.cuda.synchronize()
    print(f"rank {args.rank}: ALLREDUCE_OK value={float(t[0])} (want 3.0)", flush=True)
    dist.destroy_process_group()
    return 0 if float(t[0]) == 3.0 else 1


def check_nccl(ctx: Ctx, args) -> str:
    backend = init_world(ctx)
    ctx.fig("world1.backend", backend)
    oks = [
        sub_result(ctx, "world1.collectives", lambda: _collectives(ctx)),
        sub_result(ctx, "tp1", lambda: _tp1(ctx)),
        sub_result(ctx, "sp1", lambda: _sp1(ctx)),
        sub_result(ctx, "zero1", lambda: _zero1(ctx)),
    ]
    import torch.distributed as dist

    dist.destroy_process_group()
    sub_result(ctx, "nccl2_harness", lambda: _two_ranks_one_gpu(ctx, args) or True)
    if not ctx.cuda:
        ctx.note("no CUDA: the world of one ran on gloo and the 2-rank attempt on gloo (harness only)")
        return "skipped: no CUDA" if all(oks) else "fail"
    return "pass" if all(oks) else "fail"
