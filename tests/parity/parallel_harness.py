"""Shared helpers of the LLM-TP / FSDP / DP parity tests: a gloo spawner, tiny modules, comparisons.

``TinyLLM`` mirrors ``dhp.models``' LLMModule contract (attributes ``language_model`` = transformers
Qwen2_5_VLTextModel, ``lm_head``, ``loss_fn``; forward scatters image embeddings at image-token
positions and returns the fp32 CE SUM) with unmodified transformers modules.
"""

from __future__ import annotations

import os
import socket
import tempfile
import types
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLVisionConfig,
)
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
    Qwen2_5_VLTextModel,
)

from dhp.models.qwen2_5_vl.parallel import parallel_plan
from dhp.parallel.llm_tp import local_loss_sum

IMAGE_TOKEN = 7
PAD = 0
VOCAB = 1024
HIDDEN = 128


def text_config(**over) -> Qwen2_5_VLTextConfig:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=PAD,  # embed_tokens gets padding_idx=PAD: its row must get no gradient
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    kw.update(over)
    cfg = Qwen2_5_VLTextConfig(**kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def vision_config() -> Qwen2_5_VLVisionConfig:
    cfg = Qwen2_5_VLVisionConfig(
        depth=4,
        hidden_size=32,
        num_heads=4,
        intermediate_size=64,
        out_hidden_size=HIDDEN,
        fullatt_block_indexes=[1, 3],
        window_size=56,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


class TinyLLM(nn.Module):
    """The LLM module contract of dhp.models on unmodified transformers parts (see module docstring)."""

    def __init__(self, cfg: Qwen2_5_VLTextConfig) -> None:
        super().__init__()
        self.language_model = Qwen2_5_VLTextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.loss_fn = partial(local_loss_sum, chunk_tokens=0)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, image_embeds: torch.Tensor
    ) -> torch.Tensor:
        embeds = self.language_model.embed_tokens(input_ids)
        mask = (input_ids == IMAGE_TOKEN).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(mask, image_embeds.to(embeds.dtype))
        b, s = input_ids.shape
        pos = torch.arange(s).view(1, 1, s).expand(3, b, s)
        hidden = self.language_model(inputs_embeds=embeds, position_ids=pos).last_hidden_state
        return self.loss_fn(hidden, self.lm_head, labels)


class TinyVision(nn.Module):
    """The vision module contract: ``visual`` = transformers' encoder; forward returns pooler_output."""

    def __init__(self, cfg: Qwen2_5_VLVisionConfig) -> None:
        super().__init__()
        self.visual = Qwen2_5_VisionTransformerPretrainedModel(cfg)

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        return self.visual(pixel_values, grid_thw=image_grid_thw).pooler_output


def build_llm(seed: int = 0, **over) -> TinyLLM:
    torch.manual_seed(seed)
    cfg = text_config(**over)
    module = TinyLLM(cfg).float()
    module.parallel_plan = parallel_plan("llm", cfg, tied={})  # what the family attaches at build
    return module


def build_vision(seed: int = 0) -> TinyVision:
    torch.manual_seed(seed)
    cfg = vision_config()
    module = TinyVision(cfg).float()
    module.parallel_plan = parallel_plan("vision", types.SimpleNamespace(vision_config=cfg), tied={})
    return module


def llm_batch(seed: int, *, batch: int = 2, seq: int = 24, n_img: int = 6) -> dict[str, torch.Tensor]:
    """Token ids with ``n_img`` image tokens per row, labels with some -100, and leaf image embeddings."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, VOCAB, (batch, seq), generator=g)
    ids[:, 2 : 2 + n_img] = IMAGE_TOKEN
    labels = ids.clone()
    labels[:, : 2 + n_img] = -100
    labels[0, -3:] = -100
    ids[1, -4:] = PAD  # right padding (labels -100)
    labels[1, -4:] = -100
    ids[0, 0] = PAD + 1  # an id in rank 0's vocab range next to the padding row
    embeds = torch.randn(batch * n_img, HIDDEN, generator=g)
    return {"input_ids": ids, "labels": labels, "image_embeds": embeds}


def vision_batch(seed: int, grids: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
    """Random pixel rows for images with the given (t, h, w) patch grids (channels*2*14*14 per row)."""
    g = torch.Generator().manual_seed(seed)
    thw = torch.tensor(grids, dtype=torch.long)
    rows = int(thw.prod(-1).sum())
    return {"pixel_values": torch.randn(rows, 3 * 2 * 14 * 14, generator=g), "image_grid_thw": thw}


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (DTensor grads gathered: a collective, call on all ranks)."""
    from dhp.parallel.state import full_grad_dict

    return full_grad_dict(module)


#: a gradient whose norm is below this fraction of the model's largest gradient norm is compared at
#: that floor (see assert_grads_match)
GRAD_NORM_FLOOR = 1e-4


def assert_rel_close(
    got: torch.Tensor, want: torch.Tensor, *, rtol: float, name: str, floor: float = 1e-12
) -> None:
    """Relative error in the norm sense: ||got - want|| <= rtol * max(||want||, floor)."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).norm().item()
    scale = max(want.norm().item(), floor)
    assert err <= rtol * scale, f"{name}: relative error {err / scale:.3e} > {rtol:.1e}"


def assert_grads_match(got: dict, want: dict, *, rtol: float, tag: str) -> None:
    """Every parameter present in both, every full gradient within ``rtol`` (relative, norm sense).

    A gradient that nearly cancels (its tokens' terms sum to ~0) has fp32 rounding of the size of its
    terms, not of its sum, so its own norm is no scale for it: a gradient under ``GRAD_NORM_FLOOR``
    times the model's largest gradient norm is held to ``rtol`` of that floor instead. Seen: a tiny
    Qwen3.5's dt_bias of one DeltaNet layer, norm 2.5e-6 beside a largest of 2.0, differed by 4.7e-10
    (1.9e-4 of its own norm) between two exact computations on one CPU and passed on another. A wrong
    gradient there (off by its own size) is still 100x over the bound."""
    assert set(got) == set(want), f"{tag}: parameter sets differ: {set(got) ^ set(want)}"
    floor = GRAD_NORM_FLOOR * max((w.detach().double().norm().item() for w in want.values()), default=0.0)
    for k in want:
        assert_rel_close(got[k], want[k], rtol=rtol, name=f"{tag}: grad {k}", floor=max(floor, 1e-12))


def split_llm(batch: dict, rank: int, world: int) -> dict:
    """Replica ``rank``'s contiguous rows of an :func:`llm_batch` (and their image embeddings)."""
    rows = batch["input_ids"].shape[0] // world
    per_row = batch["image_embeds"].shape[0] // batch["input_ids"].shape[0]
    sl, el = slice(rank * rows, (rank + 1) * rows), slice(rank * rows * per_row, (rank + 1) * rows * per_row)
    return {
        "input_ids": batch["input_ids"][sl],
        "labels": batch["labels"][sl],
        "image_embeds": batch["image_embeds"][el],
    }


def llm_step(model, batch: dict, num_tokens: int):
    """Forward + backward of ``loss_sum / num_tokens`` (the GLOBAL token count); returns (loss, d/d embeds)."""
    embeds = batch["image_embeds"].clone().requires_grad_(True)
    loss = model(batch["input_ids"], batch["labels"], embeds) / num_tokens
    loss.backward()
    return loss.detach(), embeds.grad


def ref_norm_sq(grads: dict) -> float:
    """Squared L2 norm over a dict of full gradients (float64)."""
    return sum(float(g.double().pow(2).sum()) for g in grads.values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; an assertion on any rank fails the test.

    The ranks are forked from the test process, so they start with torch, transformers and dhp
    already imported (a spawned rank spends ~8 s of CPU importing them again); each rank runs
    single-threaded (``_entry``), which keeps the fork safe with the parent's OpenMP pool.
    """
    with tempfile.TemporaryDirectory():
        mp.start_processes(
            _entry, args=(world, _free_port(), fn, args), nprocs=world, join=True, start_method="fork"
        )
