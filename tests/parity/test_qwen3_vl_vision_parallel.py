"""Qwen3-VL over 2 gloo ranks: encoder TP and Ulysses SP, LLM TP: every edge and every gradient vs one process.

TP=2: each rank shards a seeded copy of the vision module with the family's own TP plan by FQN
(``family.parallel_plan("vision", ...)``: fused qkv, attention proj, MLP, the merger and every DeepStack
merger) through torch's ``parallelize_module``.

SP=2: each rank gets ``family.shard_inputs(..., sp_size=2)[rank]`` (its merge-unit slice of the patch rows
with the position-table taps, rotary ids and global ``cu_seqlens`` precomputed) and runs transformers' own
forward on it, every block's attention wrapped by a minimal Ulysses all-to-all written here (the test checks
the family's shard contract, not dhp.parallel's hooks). Each rank must output exactly the reference's rows
``token_index`` of ``image_embeds`` and of every DeepStack feature, and the parameter gradients summed over
the SP group must equal the reference's.

LLM TP=2: the decoder plan (embeddings and lm_head left whole: the vocab-parallel loss is dhp.parallel's),
fed the reference encoder's 1 + K outputs as leaves: loss, every parameter gradient and the gradient of
every edge (what goes back to the encoder) match.

The encoder checks backpropagate the same cotangent into each of the 1 + K outputs (what the LLM sends back along each
edge). fp32: only summation order changes; measured ~1e-7, asserted <= 1e-5 relative (norm sense).
"""

from __future__ import annotations

import fnmatch
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_harness import assert_grads_match, assert_rel_close, full_grads, spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor.parallel import parallelize_module
from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

from dhp.models import get_family
from dhp.models.testing import tiny_vl_batch

pytestmark = pytest.mark.parity
RTOL = 1e-5


def _ulysses_attention(self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):
    """Sequence-sharded rows -> all-to-all to head-sharded full sequence -> attention per image -> back."""
    split = [int(s) for s in kwargs.pop("ulysses_split_sizes")]
    world, rank = dist.get_world_size(), dist.get_rank()
    rows, heads, dim = hidden_states.shape[0], self.num_heads, self.head_dim
    q, k, v = self.qkv(hidden_states).reshape(rows, 3, heads, dim).unbind(1)
    q, k = apply_rotary_pos_emb_vision(q, k, *position_embeddings)
    send = torch.stack((q, k, v), 1).reshape(rows, 3, world, heads // world, dim).permute(2, 0, 1, 3, 4)
    recv = q.new_empty(sum(split), 3, heads // world, dim)
    qkv = all_to_all_single(
        recv, send.reshape(world * rows, 3, heads // world, dim).contiguous(), split, [rows] * world
    )
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    outs = []
    for seg in torch.split(qkv, lengths, dim=0):  # (L_img, 3, H/N, d), one image: full attention
        sq, sk, sv = (t.transpose(0, 1).unsqueeze(0) for t in seg.unbind(1))
        outs.append(F.scaled_dot_product_attention(sq, sk, sv, scale=self.scaling)[0].transpose(0, 1))
    out = torch.cat(outs)  # (L_total, H/N, d)
    back = all_to_all_single(
        out.new_empty(world * rows, heads // world, dim), out.contiguous(), [rows] * world, split
    )
    back = back.reshape(world, rows, heads // world, dim).permute(1, 0, 2, 3).reshape(rows, heads * dim)
    assert split[rank] == rows
    return self.proj(back)


def _build(family, cfg):
    torch.manual_seed(0)
    return family.build_module("vision", cfg, device="cpu", dtype=torch.float32)


def _run(rank: int, world: int) -> None:
    family = get_family("qwen3_vl")
    cfg = family.tiny_hf_config()
    batch = tiny_vl_batch(cfg, images=[[(8, 6), (4, 10)], [(6, 6)]], text_lens=[3, 4], seed=3)
    pixels, grid = batch["pixel_values"], batch["image_grid_thw"]
    ref = _build(family, cfg)
    ref_out = ref(pixels, grid)
    assert set(ref_out) == {e.kwarg for e in family.handoffs_for(cfg)} and len(ref_out) == 3
    gen = torch.Generator().manual_seed(7)
    cotangents = {k: torch.randn(v.shape, generator=gen) for k, v in ref_out.items()}
    torch.autograd.backward([ref_out[k] for k in cotangents], list(cotangents.values()))
    want = {n: p.grad for n, p in ref.named_parameters()}
    assert any(n.startswith("visual.deepstack_merger_list.1.") for n in want)

    # --- TP=2 with the family's plan --------------------------------------------------------------
    tp = _build(family, cfg)
    plan = tp.parallel_plan
    parallelize_module(tp, init_device_mesh("cpu", (world,)), dict(plan.tp(False)))
    for fqn, sub in tp.named_modules():
        if any(fnmatch.fnmatchcase(fqn, g) for g in plan.tp_heads):
            sub.num_heads //= world
    tp_out = tp(pixels, grid)
    for name in ref_out:
        assert_rel_close(tp_out[name], ref_out[name], rtol=RTOL, name=f"tp rank {rank} {name}")
    torch.autograd.backward([tp_out[k] for k in cotangents], list(cotangents.values()))
    assert_grads_match(full_grads(tp), want, rtol=RTOL, tag=f"tp rank {rank}")

    # --- Ulysses SP=2 with the family's shards -----------------------------------------------------
    sp = _build(family, cfg)
    for fqn, sub in sp.named_modules():
        if any(fnmatch.fnmatchcase(fqn, site.modules) for site in plan.sp):
            sub.forward = types.MethodType(_ulysses_attention, sub)
    shard = family.shard_inputs("vision", cfg, pixel_values=pixels, image_grid_thw=grid, sp_size=world)[rank]
    assert 0 < shard.num_patches < pixels.shape[0]
    sp_out = sp(**shard.forward_kwargs())
    rows = shard.token_index
    for name in ref_out:  # this rank's rows of every edge, the same rows for all of them
        assert_rel_close(sp_out[name], ref_out[name][rows], rtol=RTOL, name=f"sp rank {rank} {name}")
    torch.autograd.backward([sp_out[k] for k in cotangents], [cotangents[k][rows] for k in cotangents])
    got = {}
    for n, p in sp.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)  # each SP rank holds its tokens' partial sum
        got[n] = g
    assert_grads_match(got, want, rtol=RTOL, tag=f"sp rank {rank}")

    _llm_tp(rank, world, family, cfg, batch, {k: v.detach() for k, v in ref_out.items()})


def _llm_tp(rank: int, world: int, family, cfg, batch, edges) -> None:
    """LLM TP=2 (decoder plan, embeddings/lm_head kept whole here): the DeepStack additions between
    layers act on replicated hidden states; loss, every grad and every edge's gradient match."""

    def build():
        torch.manual_seed(1)
        return family.build_module("llm", cfg, device="cpu", dtype=torch.float32)

    def step(llm):
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in edges.items()}
        keys = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "image_grid_thw", "sample_ids")
        out = llm(**{k: batch[k] for k in keys}, **leaves)
        (out.loss_sum / out.num_tokens).backward()
        return out.loss_sum.detach(), {k: v.grad for k, v in leaves.items()}

    ref, tp = build(), build()
    styles = {
        g: st
        for g, st in tp.parallel_plan.tp(False).items()
        if g not in ("language_model.embed_tokens", "lm_head")
    }
    parallelize_module(tp, init_device_mesh("cpu", (world,)), styles)
    ref_loss, ref_edges = step(ref)
    tp_loss, tp_edges = step(tp)
    assert_rel_close(tp_loss, ref_loss, rtol=RTOL, name=f"llm tp rank {rank} loss")
    for name in ref_edges:
        assert_rel_close(tp_edges[name], ref_edges[name], rtol=RTOL, name=f"llm tp rank {rank} d/d{name}")
    assert_grads_match(
        full_grads(tp), {n: p.grad for n, p in ref.named_parameters()}, rtol=RTOL, tag="llm tp"
    )


def test_qwen3_vl_vision_tp2_and_sp2_match_one_process() -> None:
    spawn(_run, 2)
