"""Qwen3.5's LLM at tp=4 (4 gloo ranks) with Gated DeltaNet heads in the released key : value ratio (1 : 3).

The tiny Qwen3.5 model's DeltaNet layers get 8 key heads and 24 value heads (``linear_num_key_heads``,
``linear_num_value_heads``), so each TP rank holds 2 key heads and the 6 value heads that read them;
the tiny model (1 : 2, one key head per rank at tp=2) never puts several key heads, each with its
group of value heads, on one rank. The full attention gets 4 kv heads so tp=4 cuts it too. The family's own LLM module with the
family's TP plan, against the same module in one process (``tests/parity/test_split_qwen3_5.py`` holds
that module equal to transformers): loss, every full gradient and the image-embedding edge's gradient
on the whole batch (M-RoPE positions, right padding, images); every sharded DeltaNet parameter holds
exactly 1/4 of its elements on each rank. ``A_log`` is redrawn from log U(0.01, 1), as in
``tests/parity/test_qwen3_5_parallel.py``.

Tolerance (fp32, CPU; TP only reorders fp32 sums): loss within 1e-5 relative, every gradient within
1e-4 relative (norm sense).
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from parallel_harness import assert_grads_match, assert_rel_close, full_grads, spawn

from dhp.layout import ParallelLayout
from dhp.models import get_family
from dhp.models.testing import tiny_vl_batch
from dhp.parallel import build_mesh, finalize_grads, parallelize
from dhp.parallel.linear_attn_tp import local_fraction

pytestmark = [pytest.mark.parity, pytest.mark.slow]
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
#: the DeltaNet heads at 1 : 3; the gated full attention's 4 query heads get 4 kv heads so tp=4 cuts them
RELEASED_RATIO = {
    "llm.extra.linear_num_key_heads": 8,
    "llm.extra.linear_num_value_heads": 24,
    "llm.num_kv_heads": 4,
}
KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "image_grid_thw", "sample_ids")


def _hf_config(family):
    model = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(family.tiny_model_config())))
    for key, value in RELEASED_RATIO.items():
        OmegaConf.update(model, key, value)
    return family.hf_config(model)


def _build(family, cfg):
    torch.manual_seed(1)
    module = family.build_module("llm", cfg, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for fqn, param in module.named_parameters():
            if fqn.endswith("linear_attn.A_log"):
                param.copy_(torch.rand(param.shape, generator=gen).mul_(0.99).add_(0.01).log_())
    return module


def _case(rank: int, world: int) -> None:
    family = get_family("qwen3_5")
    cfg = _hf_config(family)
    assert (cfg.text_config.linear_num_key_heads, cfg.text_config.linear_num_value_heads) == (8, 24)
    batch = tiny_vl_batch(cfg, images=[[(8, 6), (4, 10)], [(6, 6)]], text_lens=[3, 70], seed=3)
    n_img = int((batch["input_ids"] == cfg.image_token_id).sum())
    edges = torch.randn(n_img, cfg.text_config.hidden_size, generator=torch.Generator().manual_seed(5))

    def step(llm):
        leaf = edges.clone().requires_grad_(True)
        out = llm(**{k: batch[k] for k in KEYS}, image_embeds=leaf)
        (out.loss_sum / out.num_tokens).backward()
        return out.loss_sum.detach(), leaf.grad

    ref = _build(family, cfg)
    ref_loss, ref_edge = step(ref)
    layout = ParallelLayout(tp=world)
    mesh = build_mesh(layout, "cpu")
    tp = parallelize("llm", _build(family, cfg), mesh, layout=layout,
                     activation_checkpointing="off", mixed_precision="fp32")  # fmt: skip
    for fqn, (local, whole) in local_fraction(tp.language_model.layers[0].linear_attn).items():
        assert local * (1 if fqn == "norm.weight" else world) == whole, (fqn, local, whole)
    loss, edge = step(tp)
    finalize_grads(tp, mesh, layout=layout)
    tag = f"tp{world} key 8 value 24 rank {rank}"
    assert_rel_close(loss, ref_loss, rtol=LOSS_RTOL, name=f"{tag} loss")
    assert_rel_close(edge, ref_edge, rtol=GRAD_RTOL, name=f"{tag} d/d image_embeds")
    want = {n: p.grad for n, p in ref.named_parameters()}
    assert_grads_match(full_grads(tp), want, rtol=GRAD_RTOL, tag=tag)


def test_qwen3_5_llm_tp4_at_the_released_deltanet_head_ratio_matches_one_process() -> None:
    spawn(_case, 4)
