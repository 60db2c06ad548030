"""LLM tensor parallelism (DTensor plan + loss_parallel) against the single-process module, on gloo.

Each rank builds the same seeded single-process model and the TP model, runs the same batch, and checks
the loss, every parameter's FULL gradient (DTensor grads gathered), and the gradient w.r.t. the input
image embeddings, which must also be identical on every TP rank (the lm_head/embedding input-grad trap).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from parallel_harness import (
    assert_grads_match,
    assert_rel_close,
    build_llm,
    full_grads,
    llm_batch,
    spawn,
)
from torch.distributed.device_mesh import init_device_mesh

from dhp.config.schema import TrainConfig
from dhp.errors import PlanError
from dhp.layout import ParallelLayout
from dhp.parallel.comm import CommCounter
from dhp.parallel.llm_tp import apply_tp
from dhp.parallel.optim import build_optimizer
from dhp.parallel.state import model_state_bytes

# fp32 on CPU: sharded matmuls and the all-reduces change the summation order only; measured
# differences are ~1e-7 relative, the contract is <= 1e-5 relative (norm sense) for every tensor.
RTOL = 1e-5

pytestmark = pytest.mark.parity


def _loss_and_grads(model, batch):
    embeds = batch["image_embeds"].clone().requires_grad_(True)
    loss = model(batch["input_ids"], batch["labels"], embeds)
    loss.backward()
    return loss.detach(), embeds.grad


def _check_model_state_bytes(ref, tp, world: int) -> None:
    """Per-rank params + grads + AdamW states at TP=N <= 1.10 x (TP=1) / N (live local tensor bytes)."""
    train, single = TrainConfig(lr=1e-3), ParallelLayout()
    mesh = tp.lm_head.weight.device_mesh
    ref_opt = build_optimizer(ref, mesh, layout=single, train=train)
    tp_opt = build_optimizer(tp, mesh, layout=ParallelLayout(tp=world), train=train)
    ref_opt.step()
    tp_opt.step()
    full, mine = model_state_bytes(ref, ref_opt)["total"], model_state_bytes(tp, tp_opt)["total"]
    assert mine <= 1.10 * full / world, f"tp={world}: {mine} B per rank vs {full} B at TP=1"


def _tp_cases(rank: int, world: int) -> None:
    batch = llm_batch(seed=1)
    ref = build_llm()
    ref_loss, ref_gin = _loss_and_grads(ref, batch)
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tp = apply_tp(build_llm(), mesh)
    # weights really are sharded: this rank holds 1/world of every planned weight
    local = tp.language_model.layers[0].mlp.up_proj.weight.to_local()
    assert local.shape[0] == 256 // world
    calls = []
    tp.lm_head.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    counter = CommCounter("llm")
    with counter:
        loss, gin = _loss_and_grads(tp, batch)
    comm = counter.step()
    # TP only all-reduces (hidden states, input grads, the chunked loss's max/sum-exp/target terms):
    # nothing is all-gathered, in particular never the (B, S, V) logits
    assert set(comm) == {"llm/all_reduce"}, comm
    assert comm["llm/all_reduce"].calls >= 2 * 2 + 1, comm  # >= o_proj + down_proj per layer + embedding
    # the chunked loss reads lm_head's local (V/N, H) rows itself: no (B, S, V/N) logits tensor is made
    assert calls == [] and tp.lm_head.weight.to_local().shape[0] == 1024 // world, calls
    assert_rel_close(loss, ref_loss, rtol=RTOL, name=f"tp={world} loss")
    assert_rel_close(gin, ref_gin, rtol=RTOL, name=f"tp={world} d loss / d image_embeds")
    gathered = [torch.empty_like(gin) for _ in range(world)]
    dist.all_gather(gathered, gin.contiguous())
    for r, g in enumerate(gathered):
        assert torch.equal(g, gin), f"input-embedding grad differs between TP ranks {rank} and {r}"
    for name, p in tp.named_parameters():  # grads are sharded like their params (no replicated (V, H) grad)
        assert getattr(p.grad, "placements", None) == getattr(p, "placements", None), name
    assert_grads_match(full_grads(tp), ref_grads, rtol=RTOL, tag=f"tp={world}")
    _check_model_state_bytes(ref, tp, world)
    if world == 2:
        _real_module_case(world, mesh, tied=False)
        _real_module_case(world, mesh, tied=True)
    if world == 4:  # 4 KV heads split 4 ways is fine; 2 KV heads are refused before any forward
        with pytest.raises(PlanError, match=r"model\.llm\.num_kv_heads=2"):
            apply_tp(build_llm(num_key_value_heads=2), mesh)


def _real_module_case(world: int, mesh, *, tied: bool) -> None:
    """dhp.models' own LLMModule (M-RoPE from mm_token_type_ids, attention mask, right padding) under TP;
    ``tied``: tie_word_embeddings (Qwen2.5-VL-3B), one (V, H) table used by embed_tokens and lm_head."""
    from dhp.models import get_family
    from dhp.models.testing import tiny_vl_batch

    family = get_family("qwen2_5_vl")
    cfg = family.tiny_model_config()
    cfg = dataclasses.replace(cfg, llm=dataclasses.replace(cfg.llm, tie_word_embeddings=tied))
    hf = family.hf_config(cfg)
    batch = tiny_vl_batch(hf, images=[[(4, 8)], [(4, 4), (2, 4)]], text_lens=[5, 9], seed=3)
    del batch["pixel_values"]
    n_img = int((batch["input_ids"] == hf.image_token_id).sum())
    embeds = torch.randn(n_img, hf.text_config.hidden_size, generator=torch.Generator().manual_seed(4))

    def run(module):
        leaf = embeds.clone().requires_grad_(True)
        out = module(**batch, image_embeds=leaf)
        out.loss_sum.backward()
        return out.loss_sum.detach(), leaf.grad

    torch.manual_seed(0)
    ref = family.build_module("llm", hf, device="cpu", dtype=torch.float32)
    torch.manual_seed(0)
    tp = apply_tp(family.build_module("llm", hf, device="cpu", dtype=torch.float32), mesh)
    assert (tp.lm_head.weight is tp.language_model.embed_tokens.weight) == tied
    ref_loss, ref_gin = run(ref)
    loss, gin = run(tp)
    assert_rel_close(loss, ref_loss, rtol=RTOL, name=f"LLMModule tp={world} loss")
    assert_rel_close(gin, ref_gin, rtol=RTOL, name=f"LLMModule tp={world} d/d image_embeds")
    assert_grads_match(
        full_grads(tp), {k: p.grad for k, p in ref.named_parameters()}, rtol=RTOL, tag="LLMModule"
    )


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_llm_tp_matches_single_process(world: int) -> None:
    """TP=2 and TP=4: loss, every full param grad, image-embedding grad (same on all ranks); TP=4 also
    checks that num_key_value_heads % tp != 0 is a PlanError."""
    spawn(_tp_cases, world)
