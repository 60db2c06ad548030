"""Synthetic samples: exact patch counts (pinned, 448 px -> 1,024 up to 3,584 px -> 65,536), determinism."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from PIL import Image

from dhp.config.schema import SpecialTokens, SyntheticData, VisionArch
from dhp.data import bad
from dhp.data.batch import IGNORE_INDEX, IMAGE
from dhp.data.processing import Limits
from dhp.data.synthetic import SyntheticSource, patches_for_side, synthetic_grid
from dhp.errors import ConfigError

pytestmark = pytest.mark.unit
TOKENS = SpecialTokens()  # Qwen2.5-VL's real ids (151643..151656)
BIG = Limits(patch_seq_len=1 << 20, token_seq_len=1 << 20)
SIDES = {448: 1024, 896: 4096, 1344: 9216, 1792: 16384, 2240: 25600, 3584: 65536}


def _source(patches: int, *, images: int = 1, text: int = 64, seed: int = 0, limits=BIG, vocab=152064):
    cfg = SyntheticData(num_samples=8, patches=patches, images_per_sample=images, text_tokens=text)
    return SyntheticSource(
        synthetic=cfg, vision=VisionArch(), tokens=TOKENS, vocab_size=vocab, limits=limits, seed=seed
    )


@pytest.mark.parametrize("side", list(SIDES))
def test_exact_patch_counts_per_image_side(side):
    patches = SIDES[side]
    assert patches_for_side(side) == patches
    assert synthetic_grid(patches, merge=2) == (1, side // 14, side // 14)
    s = _source(patches, text=100).load(3)
    assert s.num_patches == patches and s.image_grid_thw.tolist() == [[1, side // 14, side // 14]]
    assert s.pixel_values.shape == (patches, 3 * 2 * 14 * 14) and s.pixel_values.dtype == torch.float32
    assert s.num_image_tokens == patches // 4
    assert int((s.labels != IGNORE_INDEX).sum()) == 100  # exactly the requested text tokens
    assert s.num_tokens == patches // 4 + 2 + 100


@pytest.mark.parametrize("side", [448, 896, 1792])
def test_synthetic_grid_equals_the_real_processor_on_a_real_photo(tiny_model, side):
    """A real photograph resized to side x side gets the same grid from transformers' processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from dhp.data.llava import resolve_path

    proc = Qwen2VLImageProcessorPil.from_pretrained(tiny_model.path, min_pixels=3136, max_pixels=side * side)
    photo = Image.open(resolve_path("pkg://dhp.data_assets/demo/images/astronaut.jpg", key="t")).resize(
        (side, side)
    )
    out = proc(images=[photo], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [list(synthetic_grid(SIDES[side], merge=2))]


def test_non_square_and_invalid_patch_counts():
    assert synthetic_grid(64 * 4 * 2, merge=2) == (1, 16, 32)  # 512 patches: most square even grid
    assert synthetic_grid(4 * 7, merge=2) == (1, 2, 14)
    with pytest.raises(ConfigError, match="multiple of spatial_merge_size"):
        synthetic_grid(1000 + 2, merge=2)


def test_deterministic_from_seed_and_index():
    a, b, c = (
        _source(256, images=2).load(5),
        _source(256, images=2).load(5),
        _source(256, images=2, seed=1).load(5),
    )
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.pixel_values, b.pixel_values)
    assert not torch.equal(a.pixel_values, c.pixel_values) and not torch.equal(a.input_ids, c.input_ids)
    assert a.num_images == 2 and int((a.mm_token_type_ids == IMAGE).sum()) == 2 * 64
    text = a.input_ids[a.labels != IGNORE_INDEX]
    specials = torch.tensor([getattr(TOKENS, f.name) for f in fields(SpecialTokens)])
    assert not torch.isin(text, specials).any() and int(text.max()) < 152064


def test_text_only_synthetic():
    s = _source(64, images=0, text=32).load(0)
    assert s.pixel_values is None and s.num_tokens == 32


def test_limits_raise():
    with pytest.raises(bad.BadSampleError, match="vision_too_long"):
        _source(1024, images=2, limits=Limits(patch_seq_len=2047, token_seq_len=1 << 20)).load(0)
    with pytest.raises(bad.BadSampleError, match=r"text_too_long.*322 tokens"):
        _source(1024, text=64, limits=Limits(patch_seq_len=4096, token_seq_len=321)).load(0)
