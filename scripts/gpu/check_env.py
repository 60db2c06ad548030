"""Environment checks: torch/CUDA/GPU, packages and a bf16 matmul (env); the flash-attn contract (flash)."""

from __future__ import annotations

import contextlib
import importlib
import subprocess
import time

import torch
from check_helpers import Ctx, llm_kwargs, model_cfg, rel, sub_result, vl_batch

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
