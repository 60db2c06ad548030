"""Video through the split model against transformers' untouched Qwen2.5-VL (loss + every grad).

A micro-batch with an image and a video in one sample and a video alone in another: dhp feeds every
visual item in one ordered stream (the encoder reads a video as an item with t > 1 temporal patches)
and hands ``second_per_grid_ts`` to the LLM; the reference gets ``pixel_values_videos``/
``video_grid_thw``/``second_per_grid_ts`` separately. The video's time axis is observed directly:
another ``second_per_grid_ts`` changes the reference loss, and dhp follows it. The same samples packed
into one row equal the unpacked loss. Vision SP 2 + LLM TP 2 with SP on video runs through the real
runtime in ``dhp verify conf=tiny_vlm_video`` (tests/integration/test_verify.py).

Tolerance (fp32, CPU): relative 5e-6 on the loss and every gradient (max-abs sense), as the split
parity test; reordered sums only.
"""

from __future__ import annotations

import pytest
import torch

from dhp.data.batch import IGNORE_INDEX, VIDEO, Sample, VLBatch, collate
from dhp.data.packing import pack
from dhp.data.video import reference_visual_kwargs
from dhp.models import get_family
from dhp.models.testing import modules_from_reference, relative_error
from dhp.ops.cross_entropy import shifted_ce_sum

pytestmark = pytest.mark.parity
RTOL = 5e-6


@pytest.fixture(scope="module")
def setup():
    family = get_family("qwen2_5_vl")
    hf = family.hf_config(family.tiny_model_config())
    torch.manual_seed(0)
    ref = family.reference_model(hf)
    return family, hf, ref, modules_from_reference(family, ref, hf)


def _sample(hf, k: int, items: list[tuple[str, tuple[int, int, int]]], n_text: int, seconds: float) -> Sample:
    """``items``: ("image"|"video", (t, h, w)) in token order, then ``n_text`` labelled text tokens."""
    gen = torch.Generator().manual_seed(k)
    v = hf.vision_config
    ids, types = [], []
    for kind, (t, h, w) in items:
        pad, typ = (hf.video_token_id, VIDEO) if kind == "video" else (hf.image_token_id, 1)
        n = t * h * w // v.spatial_merge_size**2
        ids += [hf.vision_start_token_id, *[pad] * n, hf.vision_end_token_id]
        types += [0, *[typ] * n, 0]
    text = torch.randint(20, hf.text_config.vocab_size, (n_text,), generator=gen).tolist()
    ids, types = torch.tensor(ids + text), torch.tensor(types + [0] * n_text)
    labels = ids.clone()
    labels[: len(ids) - n_text] = IGNORE_INDEX
    grids = torch.tensor([g for _, g in items])
    width = v.in_channels * v.temporal_patch_size * v.patch_size**2
    n_vid = sum(kind == "video" for kind, _ in items)
    return Sample(
        f"v{k}",
        ids,
        labels,
        types,
        pixel_values=torch.randn(int(grids.prod(dim=1).sum()), width, generator=gen),
        image_grid_thw=grids,
        second_per_grid_ts=torch.full((n_vid,), seconds) if n_vid else None,
    )


def _samples(hf, seconds: float) -> list[Sample]:
    return [
        _sample(hf, 0, [("image", (1, 4, 4)), ("video", (2, 4, 6))], 7, seconds),
        _sample(hf, 1, [("video", (3, 4, 4))], 5, seconds),
    ]


def _reference(ref, b: VLBatch) -> tuple[torch.Tensor, dict]:
    ref.zero_grad(set_to_none=True)
    hidden = ref.model(
        input_ids=b.input_ids,
        attention_mask=b.attention_mask,
        mm_token_type_ids=b.mm_token_type_ids,
        use_cache=False,
        **reference_visual_kwargs(b),
    ).last_hidden_state
    loss = shifted_ce_sum(hidden, ref.lm_head.weight, b.labels) / b.num_label_tokens
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}


def _split(modules, b: VLBatch) -> tuple[torch.Tensor, dict]:
    vision, llm = modules["vision"], modules["llm"]
    for m in (vision, llm):
        m.zero_grad(set_to_none=True)
    embeds = vision(pixel_values=b.pixel_values, image_grid_thw=b.image_grid_thw)["image_embeds"]
    leaf = embeds.detach().requires_grad_(True)
    out = llm(
        input_ids=b.input_ids,
        attention_mask=b.attention_mask,
        labels=b.labels,
        mm_token_type_ids=b.mm_token_type_ids,
        image_grid_thw=b.image_grid_thw,
        image_embeds=leaf,
        sample_ids=b.sample_ids,
        second_per_grid_ts=b.second_per_grid_ts,
    )
    loss = out.loss_sum / b.num_label_tokens
    loss.backward()
    embeds.backward(leaf.grad)
    return loss.detach(), {(m, n): p.grad for m, mod in modules.items() for n, p in mod.named_parameters()}


def test_video_split_matches_transformers_loss_and_every_grad(setup) -> None:
    family, hf, ref, modules = setup
    batch = collate(_samples(hf, seconds=0.5), pad_token_id=hf.text_config.pad_token_id)
    ref_loss, ref_grads = _reference(ref, batch)
    loss, grads = _split(modules, batch)
    assert relative_error(loss, ref_loss) <= RTOL, (loss.item(), ref_loss.item())
    mapped = {family.checkpoint_owner(n): g for n, g in ref_grads.items()}
    assert set(mapped) == set(grads), sorted(set(mapped) ^ set(grads))
    worst = max((relative_error(grads[k], mapped[k]), k) for k in grads)
    assert worst[0] <= RTOL, worst
    # the time axis is live: 1 s per temporal patch instead of 0.5 s moves the loss, and dhp follows
    slow = collate(_samples(hf, seconds=1.0), pad_token_id=hf.text_config.pad_token_id)
    ref_slow, _ = _reference(ref, slow)
    assert abs(ref_slow - ref_loss) > 1e-6 * abs(ref_loss)
    assert relative_error(_split(modules, slow)[0], ref_slow) <= RTOL
    # packed into one row: the same loss as unpacked (per-sample temporal M-RoPE)
    packed = pack(_samples(hf, seconds=0.5), max_tokens=batch.input_ids.numel(), pad_token_id=0)
    assert packed.input_ids.shape[0] == 1
    assert relative_error(_split(modules, packed)[0], ref_loss) <= RTOL
