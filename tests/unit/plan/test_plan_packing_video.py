"""The planner sizes what packing and video feed the modules: packed LLM rows (their count and
length) and a video's encoder item (t temporal patches in one full-attention span)."""

from __future__ import annotations

import pytest

from dhp.plan.compile import image_patches, module_shapes
from dhp.validation import load_config

pytestmark = pytest.mark.unit


def test_packed_rows_and_video_items_reach_the_shapes() -> None:
    plain = module_shapes(load_config("tiny_vlm"))["llm"]
    packed = module_shapes(load_config("tiny_vlm_packed"))["llm"]
    assert (plain.micro_batch, plain.seq_len) == (2, 256)  # tiny_vlm sizes its LLM for real conversations
    # 4 samples of <= 128 tokens in rows of 256: first-fit needs at most 2*4*128/256 + 1 = 5 -> 4 rows
    assert (packed.micro_batch, packed.seq_len) == (4, 256)
    # rows of 1024: at most 2*4*128/1024 + 1 = 2 rows
    tight = module_shapes(load_config("tiny_vlm_packed", ["data.max_tokens=1024"]))["llm"]
    assert (tight.micro_batch, tight.seq_len) == (2, 1024)
    video = load_config("tiny_vlm_video")
    assert image_patches(load_config("tiny_vlm")) == 64
    assert image_patches(video) == 64 * 2  # 4 frames -> 2 temporal patches of 64 patches
    assert module_shapes(video)["vision"].image_patches == 128
