"""The checks behind ``scripts/gpu_check.sh``: one check per process, one JSON result per check.

    python scripts/gpu/checks.py CHECK --out FILE [--cpu]

CHECK is one of env, bf16, nccl, ipc, flash, mfu, train. ``--cpu`` (or a machine without CUDA)
runs tiny sizes on the CPU: checks that need CUDA report ``skipped: no CUDA`` after exercising
their harness on CPU tensors / gloo, so the script's logic can be tested anywhere.
The result is ``{"check", "status": pass|fail|skipped, "figures": {...}, "notes": [...]}``; an
exception inside a check becomes ``fail`` with the traceback's tail. Not part of the pytest suite.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# ---------------------------------------------------------------------------------------------
# helpers


class Ctx:
    """What every check gets: the device it runs on and whether this is the CPU dry mode."""

    def __init__(self, cpu: bool) -> None:
        self.cuda = torch.cuda.is_available() and not cpu
        self.dry = not self.cuda
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.figures: dict[str, Any] = {}
        self.notes: list[str] = []

    def fig(self, key: str, value: Any) -> None:
        self.figures[key] = value
        say(f"  {key} = {_fmt(value)}")

    def note(self, text: str) -> None:
        self.notes.append(text)
        say(f"  note: {text}")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def say(text: str) -> None:
    print(text, flush=True)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def tail(text: str, n: int = 1500) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def sub_result(ctx: Ctx, name: str, fn) -> bool:
    """Run one independent part of a check; record its failure instead of stopping the check."""
    try:
        ok = fn()
        ctx.fig(f"{name}.ok", bool(ok))
        return bool(ok)
    except Exception as e:
        ctx.fig(f"{name}.ok", False)
        ctx.fig(f"{name}.error", tail(f"{type(e).__name__}: {e}", 600))
        traceback.print_exc()
        return False


def model_cfg(kind: str, *, dtype: str = "float32", attn: str = "sdpa", llm_layers: int = 2, vision_depth=2):
    """A dhp ModelConfig: ``tiny`` (conf/model/tiny numbers) or ``7b`` (Qwen2.5-VL-7B widths, few layers)."""
    from dhp.config.schema import LLMArch, ModelConfig, SpecialTokens, VisionArch
    from dhp.models import get_family

    if kind == "tiny":
        mc = get_family("qwen2_5_vl").tiny_model_config()
        mc.dtype, mc.attn_implementation = dtype, attn
        return mc
    import yaml

    raw = yaml.safe_load((ROOT / "conf/model/qwen_vl_7b.yaml").read_text())
    vision = dict(raw["vision"], depth=vision_depth)
    # keep the encoder's window/full mix: every 8th block full, as in the 32-block original
    vision["fullatt_block_indexes"] = [i for i in range(vision_depth) if i % 8 == 7] or [vision_depth - 1]
    llm = dict(raw["llm"], num_layers=llm_layers)
    return ModelConfig(
        name=f"qwen_vl_7b_widths_{llm_layers}l",
        family="qwen2_5_vl",
        path=None,
        dtype=dtype,
        attn_implementation=attn,
        vision=VisionArch(**vision),
        llm=LLMArch(**llm),
        tokens=SpecialTokens(),
    )


def vl_batch(hf_config, *, grid: tuple[int, int], text: int, device: torch.device) -> dict[str, Any]:
    from dhp.models.testing import tiny_vl_batch

    b = tiny_vl_batch(hf_config, images=[[grid]], text_lens=[text], seed=0)
    # random text ids may hit the real vocab's image/video/vision ids: remap those to plain text ids
    ids, img = b["input_ids"], b["input_ids"] == hf_config.image_token_id
    specials = torch.tensor(
        [
            hf_config.image_token_id,
            hf_config.video_token_id,
            hf_config.vision_start_token_id,
            hf_config.vision_end_token_id,
        ]
    )
    structural = img | img.roll(1, dims=1) | img.roll(-1, dims=1)
    clash = torch.isin(ids, specials) & ~structural & (b["attention_mask"] == 1)
    if clash.any():
        ids[clash] = 20 + ids[clash] % 1000
        b["labels"][clash] = ids[clash]
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in b.items()}


def llm_kwargs(b: dict[str, Any]) -> dict[str, Any]:
    keys = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "image_grid_thw", "sample_ids")
    return {k: b[k] for k in keys}


def init_world(ctx: Ctx) -> str:
    """A single-rank default world: nccl on CUDA, gloo on CPU (what a dhp group of one rank gets)."""
    import torch.distributed as dist

    backend = "nccl" if ctx.cuda else "gloo"
    if not dist.is_initialized():
        kw = {"device_id": ctx.device} if ctx.cuda else {}
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, **kw
        )
    return backend


def load_transport():
    """dhp's transport module; loaded from its file when ``dhp.runtime`` cannot import (no Ray here)."""
    try:
        return importlib.import_module("dhp.runtime.transport"), "dhp.runtime.transport"
    except ImportError as e:
        spec = importlib.util.spec_from_file_location("dhp_transport", ROOT / "dhp/runtime/transport.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod, f"dhp/runtime/transport.py loaded by path (dhp.runtime needs {e.name or 'ray'})"


# ---------------------------------------------------------------------------------------------
# 1. environment + matmul


def check_env(ctx: Ctx, args) -> str:
    import platform

    ctx.fig("python", platform.python_version())
    ctx.fig("torch", torch.__version__)
    ctx.fig("torch_cuda", torch.version.cuda)
    for name in ("transformers", "safetensors", "tokenizers", "omegaconf", "hydra", "ray", "flash_attn"):
        try:
            mod = importlib.import_module(name)
            ctx.fig(f"pkg.{name}", getattr(mod, "__version__", "?"))
        except Exception as e:
            ctx.fig(f"pkg.{name}", f"missing ({type(e).__name__})")
    try:
        import dhp.models
        import dhp.parallel  # noqa: F401

        ctx.fig("dhp_import", "dhp.models + dhp.parallel ok")
    except Exception as e:
        ctx.fig("dhp_import", f"FAILED {type(e).__name__}: {e}")
    if ctx.cuda:
        p = torch.cuda.get_device_properties(0)
        ctx.fig("gpu", p.name)
        ctx.fig("gpu_mem_gib", round(p.total_memory / 2**30, 1))
        ctx.fig("sm_count", p.multi_processor_count)
        ctx.fig("capability", f"{p.major}.{p.minor}")
        with contextlib.suppress(Exception):
            v = torch.cuda.nccl.version()
            ctx.fig("nccl", ".".join(map(str, v)) if isinstance(v, tuple) else str(v))
        with contextlib.suppress(Exception):
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            ctx.fig("nvidia_smi", smi.stdout.strip())
    n = 8192 if ctx.cuda else 256
    dt = torch.bfloat16
    a = torch.randn(n, n, device=ctx.device, dtype=dt)
    b = torch.randn(n, n, device=ctx.device, dtype=dt)
    for _ in range(3):
        a @ b
    ctx.sync()
    reps = 10 if ctx.cuda else 3
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    ctx.sync()
    s = (time.perf_counter() - t0) / reps
    ctx.fig("matmul_n", n)
    ctx.fig("matmul_bf16_tflops", 2 * n**3 / s / 1e12)
    bad = "FAILED" in str(ctx.figures.get("dhp_import"))
    return "fail" if bad else "pass"


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
    cmd = [sys.executable, __file__, "_nccl2_rank", "--port", str(port)]
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


# ---------------------------------------------------------------------------------------------
# 4. CUDA IPC hand-off through dhp's transport


def _ipc_payload(i: int, n_rows: int, hidden: int, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(1000 + i)
    return torch.randn(n_rows, hidden, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)


def _ipc_consumer(cpu: bool, hidden: int, q_in, q_out, shm) -> None:
    """Consumer process: unpack each message with dhp's transport, check the bytes, report timings.

    ``ipc_keep`` messages (the event-ordering phase) copy the mapped rows on the current stream
    *before* any synchronisation and keep the mapping alive, so torch's own per-share event is
    skipped on later rounds (storage cache hit): only the transport's event orders the read.
    """
    try:
        tmod, _ = load_transport()
        cuda = torch.cuda.is_available() and not cpu
        dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
        ipc, host = tmod.CudaIpcTransport(), tmod.CpuTransport()
        want: dict[int, torch.Tensor] = {}
        kept: list[torch.Tensor] = []
        q_out.put("ready")
        while (msg := q_in.get()) is not None:
            kind, i, n_rows, t0, payload = msg
            if kind == "ipc_keep":
                kept.append(ipc.unpack(payload, device=dev))
                x = kept[-1].clone()  # enqueued behind the event wait; no synchronize before it
            elif kind == "ipc":
                x = ipc.unpack(payload, device=dev)
            else:  # host: the producer wrote int16 bytes into shared memory (numpy has no bfloat16)
                x = host.unpack(shm[: n_rows * hidden].view(n_rows, hidden).numpy(), device=dev)
            if cuda:
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            if i not in want:
                want = {i: _ipc_payload(i, n_rows, hidden, dev).view(torch.int16)}
            equal = bool(torch.equal(x.view(torch.int16), want[i]))
            del x
            q_out.put((equal, t1 - t0))
    except Exception as e:
        q_out.put(("error", tail(f"{type(e).__name__}: {e}\n{traceback.format_exc()}", 2000)))


def _shm_free_bytes() -> int:
    try:
        st = os.statvfs("/dev/shm")
        return st.f_bavail * st.f_frsize
    except OSError:
        return 0


def check_ipc(ctx: Ctx, args) -> str:
    """Producer: pack with CudaIpcTransport (no bytes move) vs D2H into shared memory + H2D (host path)."""
    import torch.multiprocessing as mp

    tmod, how = load_transport()
    ctx.fig("transport_module", how)
    hidden = 3584 if ctx.cuda else 64  # Qwen2.5-VL-7B LLM width: the merger's output rows
    sizes = [4096, 16384, 65536] if ctx.cuda else [256, 1024]  # image-token rows, bf16
    reps = 5 if ctx.cuda else 2
    free = _shm_free_bytes()
    ctx.fig("dev_shm_free_gib", round(free / 2**30, 2))
    host_rows = max([n for n in sizes if 2 * n * hidden * 2 < free], default=0)
    shm = None
    if host_rows:
        try:
            shm = torch.empty(host_rows * hidden, dtype=torch.int16).share_memory_()
        except Exception as e:
            ctx.fig("host_path_error", f"{type(e).__name__}: {e}"[:300])
    else:
        ctx.note("/dev/shm too small for the host path: only CUDA IPC measured")
    mpc = mp.get_context("spawn")
    q_in, q_out = mpc.Queue(), mpc.Queue()
    proc = mpc.Process(target=_ipc_consumer, args=(args.cpu, hidden, q_in, q_out, shm), daemon=True)
    proc.start()
    all_equal = True
    try:
        if q_out.get(timeout=90) != "ready":
            raise RuntimeError("consumer did not start")
        ipc = tmod.CudaIpcTransport()
        for i, n_rows in enumerate(sizes):
            rows = _ipc_payload(i, n_rows, hidden, ctx.device)
            nbytes = rows.numel() * rows.element_size()
            mb = f"{nbytes / 2**20:.3g}MiB"
            kinds = ("ipc", "host") if shm is not None and n_rows <= host_rows else ("ipc",)
            for kind in kinds:
                lat = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    if kind == "ipc":
                        q_in.put((kind, i, n_rows, t0, ipc.pack(rows)))
                    else:  # D2H into shared memory; the consumer copies H2D (Ray's object-store path)
                        shm[: rows.numel()].copy_(rows.view(torch.int16).reshape(-1))
                        q_in.put((kind, i, n_rows, t0, None))
                    got = q_out.get(timeout=60)
                    if got[0] == "error":
                        raise RuntimeError(f"consumer failed: {got[1]}")
                    ipc.release()
                    all_equal &= got[0]
                    lat.append(got[1])
                med = sorted(lat)[len(lat) // 2]
                ctx.fig(f"{mb}.{kind}_ms", med * 1e3)
                ctx.fig(f"{mb}.{kind}_first_ms", lat[0] * 1e3)
                ctx.fig(f"{mb}.{kind}_GBps", nbytes / med / 1e9)
        ctx.fig("bytes_equal", all_equal)
        ordered = sub_result(ctx, "event_order", lambda: _ipc_event_order(ctx, tmod, q_in, q_out, hidden))
        q_in.put(None)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if not ctx.cuda:
        ctx.note("no CUDA: harness exercised on CPU tensors (shared memory), not a CUDA IPC measurement")
        return "skipped: no CUDA" if all_equal and ordered else "fail"
    ctx.note("CUDA IPC moves no bytes: its GB/s is payload bytes / hand-off latency (pack to usable view)")
    return "pass" if all_equal and ordered else "fail"


def _ipc_event_order(ctx: Ctx, tmod, q_in, q_out, hidden: int, rounds: int = 3) -> bool:
    """The interprocess event, not a producer-side synchronize, orders each hand-off.

    One buffer is rewritten every round behind a long GPU sleep and packed at once: the producer's
    stream must still be busy after ``pack`` (the CPU did not block), the payload must carry an
    event handle, and the consumer (which keeps earlier mappings alive) must read the new bytes.
    On CPU tensors only the round trip runs (no sleep, no event).
    """
    ipc, n_rows = tmod.CudaIpcTransport(), 4096 if ctx.cuda else 256
    buf = torch.empty(n_rows, hidden, device=ctx.device, dtype=torch.bfloat16)
    busy, events, equal = [], [], []
    for r in range(rounds):
        i = 100 + r  # payload seeds distinct from the timing phase
        if ctx.cuda:
            torch.cuda._sleep(int(1e9))  # ~0.5 s of GPU spin before the write below
        buf.copy_(_ipc_payload(i, n_rows, hidden, ctx.device))
        payload = ipc.pack(buf)
        if ctx.cuda:
            busy.append(not torch.cuda.current_stream(ctx.device).query())
        events.append(isinstance(payload[1], bytes))
        q_in.put(("ipc_keep", i, n_rows, time.perf_counter(), payload))
        got = q_out.get(timeout=60)
        if got[0] == "error":
            raise RuntimeError(f"consumer failed: {got[1]}")
        equal.append(bool(got[0]))
        ipc.release()
    ctx.fig("event_order.bytes_equal", equal)
    ctx.fig("event_order.event_shipped", events)
    if not ctx.cuda:
        return all(equal) and not any(events)  # CPU tensors: no event
    ctx.fig("event_order.pack_nonblocking", busy)
    return all(equal) and all(events) and all(busy)


# ---------------------------------------------------------------------------------------------
# 5. flash-attn


def check_flash(ctx: Ctx, args) -> str:
    from dhp.models import get_family

    try:
        import flash_attn

        have = True
        ctx.fig("flash_attn", f"importable, {flash_attn.__version__}")
    except Exception as e:
        have = False
        ctx.fig("flash_attn", f"not importable: {type(e).__name__}: {e}"[:300])
    fam = get_family("qwen2_5_vl")
    mc = model_cfg("tiny", dtype="bfloat16", attn="flash_attention_2")
    cfg = fam.hf_config(mc)
    outcome = {}
    for name in ("llm", "vision"):
        try:
            m = fam.build_module(name, cfg, device=ctx.device, dtype=torch.bfloat16)
            inner = m.language_model if name == "llm" else m.visual
            outcome[name] = f"built with attn={inner.config._attn_implementation}"
        except Exception as e:
            outcome[name] = f"refused: {type(e).__name__}: {e}"[:300]
        ctx.fig(f"build_{name}", outcome[name])
    if have:
        ok = all("attn=flash_attention_2" in v for v in outcome.values())
        if ok and ctx.cuda:  # one forward through flash vs sdpa
            ok = sub_result(ctx, "flash_vs_sdpa", lambda: _flash_vs_sdpa(ctx))
        return "pass" if ok else "fail"
    refused = all(v.startswith("refused") and "lash" in v for v in outcome.values())
    if not refused:
        ctx.note("flash_attn is missing but a module was built: a silent fallback (contract broken)")
    else:
        ctx.note("flash_attn cannot be installed there; dhp refuses flash_attention_2 with a clear error")
    return "pass" if refused else "fail"


def _flash_vs_sdpa(ctx: Ctx) -> bool:
    from dhp.models import get_family

    fam = get_family("qwen2_5_vl")
    losses = {}
    for attn in ("sdpa", "flash_attention_2"):
        cfg = fam.hf_config(model_cfg("tiny", dtype="bfloat16", attn=attn))
        torch.manual_seed(0)
        llm = fam.build_module("llm", cfg, device=ctx.device, dtype=torch.bfloat16)
        b = vl_batch(cfg, grid=(8, 8), text=32, device=ctx.device)
        emb = torch.ones(16, cfg.text_config.hidden_size, device=ctx.device, dtype=torch.bfloat16)
        losses[attn] = float(llm(**llm_kwargs(b), image_embeds=emb).loss_sum)
    ctx.fig("flash_vs_sdpa.loss_rel_diff", rel(losses["flash_attention_2"], losses["sdpa"]))
    return rel(losses["flash_attention_2"], losses["sdpa"]) < 2e-2


# ---------------------------------------------------------------------------------------------
# 6. MFU: one training step of encoder + LLM on one GPU through dhp's code


def check_mfu(ctx: Ctx, args) -> str:
    import yaml
    from torch.distributed.device_mesh import init_device_mesh

    from dhp import parallel as par
    from dhp.config.schema import ParallelConfig, TrainConfig
    from dhp.metrics import llm_flops_per_step, vision_flops_per_step
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
            name, m, mesh, parallel=ParallelConfig(), activation_checkpointing=False, mixed_precision="bf16"
        )
        opts[name] = par.build_optimizer(mods[name], mesh, parallel=ParallelConfig(), train=train)
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
    flops = vision_flops_per_step(
        arch=mc.vision, llm_hidden=mc.llm.hidden_size, image_patches=[patches], frozen=False
    ) + llm_flops_per_step(arch=mc.llm, seq_lens=[seq], frozen=False)
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


# ---------------------------------------------------------------------------------------------
# 7. dhp train on one GPU (needs Ray, which is too big to carry to the device machine)

TRAIN_OVERRIDES = [
    "conf=tiny_vlm",
    "cluster=h200_1x",
    "model.dtype=bfloat16",
    "modules.vision.gpus=1",
    "modules.vision.parallel.sp=1",
    "modules.llm.gpus=1",
    "modules.llm.parallel.tp=1",
    "train.steps=3",
    "train.checkpoint_every=0",
]


def check_train(ctx: Ctx, args) -> str:
    dhp = [sys.executable, "-m", "dhp.cli"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    plan = subprocess.run(
        [*dhp, "plan", *TRAIN_OVERRIDES, "--dry-run"], capture_output=True, text=True, env=env, timeout=120
    )
    ctx.fig("plan_rc", plan.returncode)
    ctx.fig("plan_output", tail(plan.stdout + plan.stderr, 1200))
    try:
        import ray  # noqa: F401
    except ImportError:
        ctx.note(
            "ray is not importable (its wheel is ~79 MB, over the 64 MiB carry limit): dhp train skipped"
        )
        return "skipped: no ray" if plan.returncode == 0 else "fail"
    if not ctx.cuda:
        ctx.note("no CUDA: dhp train on a GPU recipe skipped (the CPU recipes are covered by make test)")
        return "skipped: no CUDA" if plan.returncode == 0 else "fail"
    out_dir = Path(args.out).parent / "train_runs"
    run = subprocess.run(
        [*dhp, "train", *TRAIN_OVERRIDES, f"train.output_dir={out_dir}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=args.train_timeout,
    )
    ctx.fig("train_rc", run.returncode)
    ctx.fig("train_output", tail(run.stdout + run.stderr, 2000))
    metrics = sorted(out_dir.glob("*/*/metrics.jsonl"))
    if metrics:
        last = metrics[-1].read_text().strip().splitlines()[-1]
        ctx.fig("train_last_metrics", json.loads(last))
    return "pass" if run.returncode == 0 and metrics else "fail"


# ---------------------------------------------------------------------------------------------

CHECKS = {
    "env": check_env,
    "bf16": check_bf16,
    "nccl": check_nccl,
    "ipc": check_ipc,
    "flash": check_flash,
    "mfu": check_mfu,
    "train": check_train,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("check", choices=[*CHECKS, "_nccl2_rank"])
    ap.add_argument("--out", default=None, help="JSON result file")
    ap.add_argument("--cpu", action="store_true", help="dry mode: tiny sizes on the CPU")
    ap.add_argument("--llm-layers", type=int, default=8, help="mfu: LLM layers at 7B widths")
    ap.add_argument("--vision-depth", type=int, default=32, help="mfu: encoder blocks (7B encoder: 32)")
    ap.add_argument(
        "--widths", choices=["auto", "7b"], default="auto", help="mfu: 7b forces 7B widths on CPU"
    )
    ap.add_argument(
        "--grid", type=int, default=0, help="mfu: image grid side in patches (0: 64 = 4096 patches)"
    )
    ap.add_argument("--text", type=int, default=2048, help="mfu: text tokens with --grid")
    ap.add_argument("--nccl2-timeout", type=int, default=40)
    ap.add_argument("--train-timeout", type=int, default=150)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    if args.check == "_nccl2_rank":
        return nccl2_rank(args)
    ctx = Ctx(args.cpu)
    say(f"== {args.check} ({'cuda' if ctx.cuda else 'cpu dry mode'})")
    t0 = time.perf_counter()
    try:
        status = CHECKS[args.check](ctx, args)
        error = None
    except Exception as e:
        traceback.print_exc()
        status, error = "fail", tail(f"{type(e).__name__}: {e}\n{traceback.format_exc()}", 3000)
    status, status_text = status.split(":")[0], status
    result = {
        "check": args.check,
        "status": status,
        "status_text": status_text,
        "device": "cuda" if ctx.cuda else "cpu",
        "wall_s": round(time.perf_counter() - t0, 2),
        "figures": ctx.figures,
        "notes": ctx.notes,
        "error": error,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    say(f"== {args.check}: {status_text} ({result['wall_s']} s)")
    return 0 if status in ("pass", "skipped") else 1


if __name__ == "__main__":
    sys.exit(main())
