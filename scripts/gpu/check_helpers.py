"""Shared helpers of the GPU checks: the per-check context, output, ports, small figures, tiny/7B-width
model configs and batches, a world of one rank, and dhp's transport module."""

from __future__ import annotations

import importlib
import importlib.util
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


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
    vision["extra"] = dict(
        vision["extra"],
        fullatt_block_indexes=[i for i in range(vision_depth) if i % 8 == 7] or [vision_depth - 1],
    )
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
        return importlib.import_module("dhp.runtime.handoff.transport"), "dhp.runtime.handoff.transport"
    except ImportError as e:
        spec = importlib.util.spec_from_file_location(
            "dhp_transport", ROOT / "dhp/runtime/handoff/transport.py"
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod, f"dhp/runtime/handoff/transport.py loaded by path (dhp.runtime needs {e.name or 'ray'})"
