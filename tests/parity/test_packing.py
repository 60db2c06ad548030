"""Sequence packing: a packed micro-batch against the same samples unpacked, one process and TP 2 + SP.

dhp.models' own LLMModule. Samples of mixed lengths (multi-image, text-only) are packed by
``dhp.data.packing.pack`` into two rows; the reference runs every sample alone (its own batch, its own
``get_rope_index``) and sums the loss sums. Every sample's M-RoPE positions restart in the packed row,
and attention never crosses samples: otherwise the numbers differ. The packed label count equals the
unpacked one (same normaliser). A "flash" attention implementation (one that runs SDPA per
``cu_seq_lens`` sequence on CPU) proves the varlen kwargs the GPU path hands to flash attention.

Tolerance (fp32, CPU): loss within 1e-5 relative, every gradient within 1e-5 relative (norm sense,
tighter than the 1e-4 absolute bar); masked-out keys and reordered sums only move the last bits.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from parallel_harness import assert_grads_match, assert_rel_close, full_grads, spawn
from torch.distributed.device_mesh import init_device_mesh
from transformers import AttentionInterface

from dhp.data.batch import Sample
from dhp.data.packing import is_packed, pack, unpack

pytestmark = pytest.mark.parity

RTOL = 1e-5
# (images as (grid_h, grid_w), text tokens) per sample; max_tokens packs them into 2 rows
SAMPLES = [([(4, 8)], 5), ([], 13), ([(2, 4), (4, 4)], 3), ([], 6), ([(4, 6)], 9)]
MAX_TOKENS = 40


def _samples(hf) -> list[Sample]:
    from dhp.models.testing import tiny_vl_batch

    out = []
    for k, (images, n_text) in enumerate(SAMPLES):
        b = tiny_vl_batch(hf, images=[images], text_lens=[n_text], seed=k)
        out.append(
            Sample(
                sample_id=f"s{k}",
                input_ids=b["input_ids"][0],
                labels=b["labels"][0],
                mm_token_type_ids=b["mm_token_type_ids"][0],
                pixel_values=b["pixel_values"],
                image_grid_thw=b["image_grid_thw"],
            )
        )
    return out


def _embeds(batch, hf, seed: int) -> torch.Tensor | None:
    n = int((batch.input_ids == hf.image_token_id).sum())
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, hf.text_config.hidden_size, generator=gen) if n else None


def _forward(module, batch, embeds):
    return module(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        labels=batch.labels,
        mm_token_type_ids=batch.mm_token_type_ids,
        image_grid_thw=batch.image_grid_thw,
        image_embeds=embeds,
        sample_ids=batch.sample_ids,
    )


def _reference(family, hf, samples):
    """Each sample alone through the single-process module; summed loss, grads, image-embeds grad."""
    torch.manual_seed(0)
    ref = family.build_module("llm", hf, device="cpu", dtype=torch.float32)
    packed = pack(samples, max_tokens=MAX_TOKENS, pad_token_id=hf.text_config.pad_token_id)
    all_embeds = _embeds(packed, hf, seed=3)
    leaf = all_embeds.clone().requires_grad_(True)
    loss, tokens, at = 0.0, 0, 0
    for one in unpack(packed):
        n = int((one.input_ids == hf.image_token_id).sum())
        out = _forward(ref, one, leaf[at : at + n] if n else None)
        at += n
        loss = loss + out.loss_sum
        tokens += out.num_tokens
    loss.backward()
    return (
        packed,
        all_embeds,
        loss.detach(),
        tokens,
        {k: p.grad for k, p in ref.named_parameters()},
        leaf.grad,
    )


def _cpu_varlen(module, query, key, value, attention_mask, *, cu_seq_lens_q=None, **kwargs):
    """A stand-in "flash" kernel on CPU: causal SDPA per ``cu_seq_lens`` sequence of the flattened rows."""
    assert attention_mask is None and cu_seq_lens_q is not None, "the varlen kwargs did not arrive"
    b, h, s, d = query.shape
    rep = h // key.shape[1]
    q, k, v = (x.transpose(1, 2).reshape(b * s, -1, d) for x in (query, key, value))
    out = torch.empty_like(q)
    bounds = cu_seq_lens_q.tolist()
    for lo, hi in itertools.pairwise(bounds):
        qi, ki, vi = (x[lo:hi].transpose(0, 1) for x in (q, k, v))
        ki, vi = ki.repeat_interleave(rep, 0), vi.repeat_interleave(rep, 0)
        out[lo:hi] = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True).transpose(0, 1)
    return out.reshape(b, s, h, d), None


AttentionInterface.register("flash_cpu_varlen_test", _cpu_varlen)


@pytest.mark.parametrize("attn", ["sdpa", "flash_cpu_varlen_test"])
def test_packing_matches_unpacked_sum_single_process(attn: str) -> None:
    """SDPA (block-diagonal mask from restarting positions) and the varlen path: loss, label count,
    every parameter grad and the image-embedding grad equal the per-sample sum."""
    from dhp.models import get_family

    family = get_family("qwen2_5_vl")
    hf = family.hf_config(family.tiny_model_config())
    samples = _samples(hf)
    packed, embeds, ref_loss, ref_tokens, ref_grads, ref_gin = _reference(family, hf, samples)
    assert packed.input_ids.shape[0] == 2 and is_packed(packed.attention_mask)
    assert packed.num_label_tokens == sum(s.num_label_tokens for s in samples) == ref_tokens
    torch.manual_seed(0)
    mod = family.build_module("llm", hf, device="cpu", dtype=torch.float32)
    mod.language_model.config._attn_implementation = attn
    leaf = embeds.clone().requires_grad_(True)
    out = _forward(mod, packed, leaf)
    out.loss_sum.backward()
    assert out.num_tokens == ref_tokens
    assert_rel_close(out.loss_sum, ref_loss, rtol=RTOL, name=f"{attn} loss")
    assert_grads_match({k: p.grad for k, p in mod.named_parameters()}, ref_grads, rtol=RTOL, tag=attn)
    assert_rel_close(leaf.grad, ref_gin, rtol=RTOL, name=f"{attn} d/d image_embeds")


def _tp_sp(rank: int, world: int) -> None:
    from dhp.models import get_family
    from dhp.parallel.llm_tp import apply_tp, sequence_shard_rows

    family = get_family("qwen2_5_vl")
    hf = family.hf_config(family.tiny_model_config())
    packed, embeds, ref_loss, ref_tokens, ref_grads, ref_gin = _reference(family, hf, _samples(hf))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    sp = apply_tp(
        family.build_module("llm", hf, device="cpu", dtype=torch.float32),
        mesh,
        sequence_parallel=True,
        loss_chunk_tokens=7,
    )
    own = sequence_shard_rows(packed.input_ids, hf.image_token_id, tp=world, rank=rank)
    leaf = (embeds * own.unsqueeze(1)).requires_grad_(True)  # the hand-off: own shard's rows only
    out = _forward(sp, packed, leaf)
    out.loss_sum.backward()
    assert out.num_tokens == ref_tokens
    assert_rel_close(out.loss_sum, ref_loss, rtol=RTOL, name="tp+sp packed loss")
    assert_grads_match(full_grads(sp), ref_grads, rtol=RTOL, tag="tp+sp packed")
    assert_rel_close(leaf.grad, ref_gin, rtol=RTOL, name="tp+sp packed d/d image_embeds")


def test_packing_tp2_sequence_parallel_matches_unpacked_sum() -> None:
    """LLM TP 2 with SP (odd packed length, padded inside; 7-token loss chunks) against the per-sample sum."""
    spawn(_tp_sp, 2)
