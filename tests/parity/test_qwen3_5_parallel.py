"""Qwen3.5 over 2 gloo ranks through ``dhp.parallel.parallelize``: encoder Ulysses SP=2 and TP=2, LLM
FSDP=2 and TP=2 (with and without sequence parallelism inside TP), each vs one process.

Encoder SP=2 (the shared Qwen3 encoder without DeepStack): each rank runs the family's own shard
(``family.shard_inputs(..., sp_size=2)[rank]``: its merge-unit slice of the patch rows with the
position-table taps, rotary ids and global ``cu_seqlens`` precomputed) through transformers' forward
with dhp's Ulysses hooks on every block's attention; its output must be exactly the reference's rows
``token_index`` of ``image_embeds``, and after ``finalize_grads`` (the SP all-reduce) every parameter's
gradient must equal the reference's. Encoder TP=2: the family's plan by FQN (fused qkv, proj, MLP,
merger), every gradient gathered.

LLM FSDP=2: rank r runs sample r of a two-sample batch (its own image rows as a leaf), the loss divided
by the whole batch's label-token count; the reduce-scattered gradients (Gated DeltaNet conv1d, dt_bias,
A_log, gated norm, the gated attention's q/k norms included) must equal the one-process gradients of
the whole batch, and each rank's edge gradient the reference's rows.

LLM TP=2: the family's plan (gated attention by heads, Gated DeltaNet by key/value head groups, MLPs,
vocab-parallel embeddings, lm_head and loss) on the whole batch (M-RoPE positions, right padding,
images): loss, every full gradient and the edge's gradient; each rank holds exactly 1/2 of every
DeltaNet parameter (the gated norm's dv-sized weight, shared by the heads, excepted). The reference's ``A_log`` is redrawn
from log U(0.01, 1) (see tests/parity/test_split_qwen3_5.py: transformers' init leaves several tiny
heads with ~1e-6 gradients that only measure fp32 rounding).

fp32: only summation order changes; asserted <= 1e-5 relative (norm sense) for outputs, the loss and
every gradient (the done-when bar is 1e-5 loss / 1e-4 per grad; this is tighter).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_harness import assert_grads_match, assert_rel_close, full_grads, spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dhp.layout import ParallelLayout
from dhp.models import get_family
from dhp.models.testing import tiny_vl_batch
from dhp.parallel import finalize_grads, parallelize
from dhp.parallel.linear_attn_tp import local_fraction

pytestmark = pytest.mark.parity
RTOL = 1e-5
IMAGES, TEXT = [[(8, 6), (4, 10)], [(6, 6)]], [3, 70]  # sample 1: 84 tokens, two delta-rule chunks


def _build(family, cfg, name: str, seed: int):
    torch.manual_seed(seed)
    module = family.build_module(name, cfg, device="cpu", dtype=torch.float32)
    with torch.no_grad():  # slow decay: see the module docstring
        gen = torch.Generator().manual_seed(seed)
        for fqn, param in module.named_parameters():
            if fqn.endswith("linear_attn.A_log"):
                param.copy_(torch.rand(param.shape, generator=gen).mul_(0.99).add_(0.01).log_())
    return module


def _vision(rank: int, world: int, family, cfg, batch) -> None:
    pixels, grid = batch["pixel_values"], batch["image_grid_thw"]
    ref = _build(family, cfg, "vision", 0)
    ref_out = ref(pixels, grid)
    assert set(ref_out) == {"image_embeds"}
    cot = torch.randn(ref_out["image_embeds"].shape, generator=torch.Generator().manual_seed(7))
    ref_out["image_embeds"].backward(cot)
    want = {n: p.grad for n, p in ref.named_parameters()}

    par = ParallelLayout(sp=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    sp = parallelize("vision", _build(family, cfg, "vision", 0), mesh, layout=par,
                     activation_checkpointing=False, mixed_precision="fp32")  # fmt: skip
    shard = family.shard_inputs("vision", cfg, pixel_values=pixels, image_grid_thw=grid, sp_size=world)[rank]
    assert 0 < shard.num_patches < pixels.shape[0]
    out = sp(**shard.forward_kwargs())["image_embeds"]
    rows = shard.token_index
    assert_rel_close(out, ref_out["image_embeds"][rows], rtol=RTOL, name=f"sp rank {rank} image_embeds")
    out.backward(cot[rows])
    finalize_grads(sp, mesh, layout=par)
    assert_grads_match({n: p.grad for n, p in sp.named_parameters()}, want, rtol=RTOL, tag=f"sp rank {rank}")

    par = ParallelLayout(tp=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tp = parallelize("vision", _build(family, cfg, "vision", 0), mesh, layout=par,
                     activation_checkpointing=False, mixed_precision="fp32")  # fmt: skip
    assert isinstance(tp.visual.blocks[0].attn.qkv.weight, DTensor)
    out = tp(pixels, grid)["image_embeds"]
    assert_rel_close(out, ref_out["image_embeds"], rtol=RTOL, name=f"tp rank {rank} image_embeds")
    out.backward(cot)
    assert_grads_match(full_grads(tp), want, rtol=RTOL, tag=f"tp rank {rank}")


def _sample(batch, hf_config, b: int) -> tuple[dict, slice]:
    """Sample ``b`` of ``batch`` as a one-row batch, and the rows of its image tokens in ``image_embeds``."""
    counts = (batch["input_ids"] == hf_config.image_token_id).sum(1).tolist()
    per_image = [len(s) for s in IMAGES]
    rows = slice(sum(counts[:b]), sum(counts[: b + 1]))
    grids = batch["image_grid_thw"][sum(per_image[:b]) : sum(per_image[: b + 1])]
    keys = ("input_ids", "attention_mask", "labels", "mm_token_type_ids")
    return {**{k: batch[k][b : b + 1] for k in keys}, "image_grid_thw": grids, "sample_ids": [f"s{b}"]}, rows


def _llm(rank: int, world: int, family, cfg, batch) -> None:
    keys = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "image_grid_thw", "sample_ids")
    n_img = int((batch["input_ids"] == cfg.image_token_id).sum())
    edges = torch.randn(n_img, cfg.text_config.hidden_size, generator=torch.Generator().manual_seed(5))
    ref = _build(family, cfg, "llm", 1)
    leaf = edges.clone().requires_grad_(True)
    out = ref(**{k: batch[k] for k in keys}, image_embeds=leaf)
    total = out.num_tokens
    (out.loss_sum / total).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}

    par = ParallelLayout(fsdp=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    model = parallelize("llm", _build(family, cfg, "llm", 1), mesh, layout=par,
                        activation_checkpointing=False, mixed_precision="fp32")  # fmt: skip
    assert isinstance(model.language_model.layers[0].linear_attn.in_proj_qkv.weight, DTensor)
    sample, rows = _sample(batch, cfg, rank)
    mine = edges[rows].clone().requires_grad_(True)
    got = model(**sample, image_embeds=mine)
    (got.loss_sum / total).backward()
    finalize_grads(model, mesh, layout=par)
    loss = got.loss_sum.detach().clone()
    dist.all_reduce(loss)
    assert_rel_close(loss, out.loss_sum, rtol=RTOL, name="fsdp llm loss sum")
    assert_rel_close(mine.grad, leaf.grad[rows], rtol=RTOL, name=f"fsdp rank {rank} d/d image_embeds")
    assert_grads_match(full_grads(model), want, rtol=RTOL, tag=f"fsdp llm rank {rank}")


def _llm_tp(rank: int, world: int, family, cfg, batch, *, sequence_parallel: bool) -> None:
    """LLM TP=2 through ``parallelize`` (the family's plan: gated attention, Gated DeltaNet heads, MLPs,
    vocab-parallel embeddings / lm_head / loss), with or without sequence parallelism inside TP: the
    whole batch on both ranks; loss, every full gradient and the edge's gradient match one process, and
    every DeltaNet parameter but the shared norm weight is exactly 1/2 on each rank."""
    keys = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "image_grid_thw", "sample_ids")
    n_img = int((batch["input_ids"] == cfg.image_token_id).sum())
    edges = torch.randn(n_img, cfg.text_config.hidden_size, generator=torch.Generator().manual_seed(5))

    def step(llm):
        leaf = edges.clone().requires_grad_(True)
        out = llm(**{k: batch[k] for k in keys}, image_embeds=leaf)
        (out.loss_sum / out.num_tokens).backward()
        return out.loss_sum.detach(), leaf.grad

    ref = _build(family, cfg, "llm", 1)
    ref_loss, ref_edge = step(ref)
    par = ParallelLayout(tp=world, sequence_parallel=sequence_parallel)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tp = parallelize("llm", _build(family, cfg, "llm", 1), mesh, layout=par,
                     activation_checkpointing=False, mixed_precision="fp32")  # fmt: skip
    tag = f"llm tp{world}{' +sp' if sequence_parallel else ''} rank {rank}"
    fractions = local_fraction(tp.language_model.layers[0].linear_attn)
    assert set(fractions) == {"in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                              "conv1d.weight", "A_log", "dt_bias", "out_proj.weight", "norm.weight"}  # fmt: skip
    for fqn, (local, whole) in fractions.items():
        assert local * (1 if fqn == "norm.weight" else world) == whole, (tag, fqn, local, whole)
    loss, edge = step(tp)
    finalize_grads(tp, mesh, layout=par)
    assert_rel_close(loss, ref_loss, rtol=RTOL, name=f"{tag} loss")
    assert_rel_close(edge, ref_edge, rtol=RTOL, name=f"{tag} d/d image_embeds")
    assert_grads_match(full_grads(tp), {n: p.grad for n, p in ref.named_parameters()}, rtol=RTOL, tag=tag)


def _run(rank: int, world: int) -> None:
    family = get_family("qwen3_5")
    cfg = family.tiny_hf_config()
    batch = tiny_vl_batch(cfg, images=IMAGES, text_lens=TEXT, seed=3)
    _vision(rank, world, family, cfg, batch)
    _llm(rank, world, family, cfg, batch)
    for sequence_parallel in (False, True):
        _llm_tp(rank, world, family, cfg, batch, sequence_parallel=sequence_parallel)


def test_qwen3_5_encoder_sp2_tp2_llm_fsdp2_and_tp2_match_one_process() -> None:
    spawn(_run, 2)
