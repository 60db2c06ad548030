"""Sequence parallelism inside the LLM's TP group + the chunked vocab-parallel loss, against one process.

dhp.models' own LLMModule (M-RoPE from mm_token_type_ids, attention mask, right padding) under
``apply_tp(sequence_parallel=True)`` with a small loss chunk, on gloo: the loss, every parameter's
FULL gradient and the gradient w.r.t. the image embeddings equal the single-process module with the
default (one-chunk) loss. Batches: several images in one sample, a text-only batch, and sequence
lengths that TP does not divide (padded inside, masked out of the loss). Each rank is handed only the
image-embedding rows of its own sequence shard (the others are zero), as the runtime does.

Tolerance (fp32, CPU): loss within 1e-5 relative, every gradient within 1e-4 absolute-max and 1e-5
relative (norm sense); the reduce-scatters/all-gathers and the chunk sums only reorder fp32 sums
(measured ~1e-7 relative).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_harness import assert_grads_match, assert_rel_close, full_grads, spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dhp.layout import ParallelLayout
from dhp.parallel.comm import CommCounter
from dhp.parallel.llm_tp import apply_tp, sequence_shard_rows
from dhp.parallel.optim import finalize_grads, grad_norm_sq

RTOL = 1e-5
CHUNK = 5  # tokens per loss chunk: divides none of the label counts below

pytestmark = pytest.mark.parity

# (images per sample as (grid_h, grid_w) in patches, text tokens per sample)
CASES = {
    "multi_image": ([[(4, 8), (4, 4)], [(2, 4)]], [5, 9]),
    "text_only": ([[], []], [13, 6]),
    "one_image_odd_len": ([[(4, 6)], []], [4, 14]),
}


def _run(module, batch, embeds):
    leaf = None if embeds is None else embeds.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out = module(**batch, image_embeds=leaf)
    (out.loss_sum / max(out.num_tokens, 1)).backward()
    return out.loss_sum.detach(), (None if leaf is None else leaf.grad), out.num_tokens


def _sp_cases(rank: int, world: int) -> None:
    from dhp.models import get_family
    from dhp.models.testing import tiny_vl_batch

    family = get_family("qwen2_5_vl")
    hf = family.hf_config(family.tiny_model_config())
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ref = family.build_module("llm", hf, device="cpu", dtype=torch.float32)
    torch.manual_seed(0)
    sp = apply_tp(
        family.build_module("llm", hf, device="cpu", dtype=torch.float32),
        mesh,
        sequence_parallel=True,
        loss_chunk_tokens=CHUNK,
    )
    seen = []
    sp.language_model.layers[0].input_layernorm.register_forward_hook(lambda m, i, o: seen.append(o))
    # TP=4 (slow tier) runs the multi-image case only: every case's length is odd (divisible by neither)
    for name, (images, text_lens) in CASES.items() if world == 2 else [("multi_image", CASES["multi_image"])]:
        batch = tiny_vl_batch(hf, images=images, text_lens=text_lens, seed=len(name))
        del batch["pixel_values"]
        seq = batch["input_ids"].shape[1]
        n_img = int((batch["input_ids"] == hf.image_token_id).sum())
        embeds = None
        if n_img:
            embeds = torch.randn(
                n_img, hf.text_config.hidden_size, generator=torch.Generator().manual_seed(4)
            )
        ref_loss, ref_gin, n_tok = _run(ref, batch, embeds)
        mine = None
        if embeds is not None:  # the hand-off delivers only this rank's sequence shard of the rows
            own = sequence_shard_rows(batch["input_ids"], hf.image_token_id, tp=world, rank=rank)
            mine = embeds * own.unsqueeze(1)
        counter = CommCounter("llm")
        seen.clear()
        with counter:
            loss, gin, n_tok_sp = _run(sp, batch, mine)
        comm = counter.step()
        assert n_tok_sp == n_tok, name
        # the residual stream really is sequence-sharded: layer 0's norm output is a Shard(1) DTensor
        # holding 1/world of the padded sequence on this rank
        out = seen[0]
        assert isinstance(out, DTensor) and out.to_local().shape[1] * world >= seq, name
        assert out.to_local().shape[1] == -(-seq // world), (name, out.to_local().shape, seq)
        assert {"llm/all_gather", "llm/reduce_scatter"} <= set(comm), (name, comm)
        assert_rel_close(loss, ref_loss, rtol=RTOL, name=f"{name} sp tp={world} loss")
        ref_grads = {k: p.grad for k, p in ref.named_parameters()}
        assert_grads_match(full_grads(sp), ref_grads, rtol=RTOL, tag=f"{name} sp")
        # the SP norms' Partial grads are reduced by finalize_grads; then the global norm is the reference's
        finalize_grads(sp, mesh, layout=ParallelLayout(tp=world, sequence_parallel=True))
        assert not any(
            p.grad.placements[0].is_partial() for p in sp.parameters() if isinstance(p.grad, DTensor)
        )
        ref_sq = sum(float(g.double().pow(2).sum()) for g in ref_grads.values())
        assert abs(grad_norm_sq(sp, mesh) - ref_sq) <= 1e-5 * ref_sq, name
        if embeds is not None:
            assert_rel_close(gin, ref_gin, rtol=RTOL, name=f"{name} d/d image_embeds")
            gathered = [torch.empty_like(gin) for _ in range(world)]
            dist.all_gather(gathered, gin.contiguous())
            assert all(torch.equal(g, gin) for g in gathered), f"{name}: image grads differ across TP"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_llm_sequence_parallel_chunked_matches_single_process(world: int) -> None:
    """TP=2 (every case) and TP=4 (slow; multi-image) with SP on and a 5-token loss chunk: loss, every
    param grad, the image-embedding grads (identical on every TP rank) and the finalized grad norm."""
    spawn(_sp_cases, world)
