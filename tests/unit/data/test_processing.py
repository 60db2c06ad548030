"""Qwen2.5-VL processing of real images: parity with transformers' processor, labels, limits, bad files."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import demo_data, jsonl_data
from PIL import Image
from transformers import Qwen2_5_VLProcessor

from dhp.data import bad
from dhp.data.batch import IGNORE_INDEX, IMAGE
from dhp.data.source import build_source
from dhp.errors import ConfigError

pytestmark = pytest.mark.unit
BIG = 1 << 20  # limits that never bind


class _ImageTextProcessor(Qwen2_5_VLProcessor):
    """transformers' processor without the video part (which needs torchvision, absent here)."""

    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None, **kwargs)


def _source(model, data, *, vision=BIG, llm=BIG):
    return build_source(data=data, model=model, patch_seq_len=vision, token_seq_len=llm, seed=0)[0]


def _find(src, sample_id_suffix: str) -> int:
    return next(i for i in range(len(src)) if src.location(i).endswith(sample_id_suffix))


def _write(tmp_path, records):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_matches_transformers_processor_on_real_multi_image_sample(tiny_model):
    """Token ids, mm_token_type_ids, pixel rows and grids equal HF's Qwen2.5-VL processor (exact)."""
    src = _source(tiny_model, demo_data())
    sample = src.load(_find(src, "mixed.jsonl:3"))  # three real photographs
    proc = src.processor
    record = src.datasets[1].record(2)
    messages = [
        {"role": r, "content": t.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")}
        for r, t in record.turns
    ]
    text = proc.tokenizer.apply_chat_template(messages, tokenize=False)
    hf = _ImageTextProcessor(image_processor=proc.image_processor, tokenizer=proc.tokenizer)
    images = [Image.open(p) for p in record.images]
    ref = hf(text=[text], images=images, return_tensors="pt", return_mm_token_type_ids=True)
    assert sample.num_images == 3
    assert torch.equal(sample.input_ids, ref["input_ids"][0])
    assert torch.equal(sample.mm_token_type_ids, ref["mm_token_type_ids"][0])
    assert torch.equal(sample.image_grid_thw, ref["image_grid_thw"])
    assert torch.equal(sample.pixel_values, ref["pixel_values"])  # same code path: exact


def test_labels_cover_assistant_turns_only(tiny_model):
    src = _source(tiny_model, demo_data())
    tok = src.processor.tokenizer
    for suffix, answers in [
        ("captions.json[16]", ["It is a tabby cat.", "Its eyes are yellow-green."]),
        ("mixed.jsonl:7", ["Gravel.", "Grass, or a brick pavement."]),  # text-only with a system turn
    ]:
        s = src.load(_find(src, suffix))
        labelled = s.labels != IGNORE_INDEX
        assert torch.equal(s.labels[labelled], s.input_ids[labelled])
        assert tok.decode(s.labels[labelled]) == "".join(a + "<|im_end|>" for a in answers)
        assert not labelled[s.mm_token_type_ids == IMAGE].any()


def test_image_tokens_expand_to_merged_patch_count(tiny_model):
    src = _source(tiny_model, demo_data())
    s = src.load(_find(src, "captions.json[0]"))  # astronaut, 448x448
    assert s.image_grid_thw.tolist() == [[1, 32, 32]]  # 448 px, patch 14 -> 1024 patches
    assert s.pixel_values.shape == (1024, 3 * 2 * 14 * 14)
    assert s.num_image_tokens == 256 == int((s.input_ids == tiny_model.tokens.image_token_id).sum())
    pos = (s.mm_token_type_ids == IMAGE).nonzero().flatten()
    assert pos.max() - pos.min() + 1 == 256  # one contiguous block
    assert s.input_ids[pos.min() - 1] == tiny_model.tokens.vision_start_token_id
    assert s.input_ids[pos.max() + 1] == tiny_model.tokens.vision_end_token_id


def test_text_only_sample_has_no_pixels(tiny_model):
    src = _source(tiny_model, demo_data())
    s = src.load(_find(src, "mixed.jsonl:5"))
    assert s.pixel_values is None and s.image_grid_thw is None and s.num_image_tokens == 0
    assert s.num_label_tokens > 0


@pytest.mark.parametrize(
    ("min_px", "max_px", "grid"),
    [
        (56 * 56, 224 * 224, [1, 16, 16]),  # max_pixels shrinks the 448 px astronaut
        (896 * 896, 1024 * 1024, [1, 64, 64]),  # min_pixels enlarges it
    ],
)
def test_min_max_pixels_from_config(tiny_model, min_px, max_px, grid):
    src = _source(tiny_model, demo_data(min_pixels=min_px, max_pixels=max_px))
    s = src.load(_find(src, "captions.json[0]"))
    assert s.image_grid_thw.tolist() == [grid]


def test_missing_and_corrupt_images(tiny_model, demo_copy):
    (demo_copy / "images" / "cat.jpg").unlink()
    raw = (demo_copy / "images" / "rocket.jpg").read_bytes()
    (demo_copy / "images" / "rocket.jpg").write_bytes(raw[: len(raw) // 2])  # truncated JPEG
    (demo_copy / "images" / "coins.jpg").write_bytes(b"not an image at all")

    def rec(name):
        return {
            "image": name,
            "conversations": [
                {"from": "human", "value": "<image>"},
                {"from": "gpt", "value": "x"},
            ],
        }

    path = _write(demo_copy, [rec("cat.jpg"), rec("rocket.jpg"), rec("coins.jpg"), rec("astronaut.jpg")])
    src = _source(tiny_model, jsonl_data(path, demo_copy / "images"))
    expected = [
        (bad.MISSING_FILE, "cat.jpg does not exist"),
        (bad.CORRUPT_IMAGE, "rocket.jpg cannot be decoded"),
        (bad.CORRUPT_IMAGE, "coins.jpg cannot be decoded"),
    ]
    for i, (reason, needle) in enumerate(expected):
        with pytest.raises(bad.BadSampleError) as info:
            src.load(i)
        assert info.value.reason == reason and needle in str(info.value)
        assert info.value.location == f"{path}:{i + 1}"
    assert src.load(3).num_patches == 1024


def test_vision_and_text_limits_raise_never_truncate(tiny_model):
    src = _source(tiny_model, demo_data(), vision=1023, llm=BIG)
    i = _find(src, "captions.json[0]")
    with pytest.raises(
        bad.BadSampleError, match=r"vision_too_long.*1024 patches \[1024\] > modules.vision.seq_len=1023"
    ):
        src.load(i)
    n = _source(tiny_model, demo_data()).load(i).num_tokens
    with pytest.raises(
        bad.BadSampleError, match=rf"text_too_long.*{n} tokens \(256 image\) > modules.llm.seq_len={n - 1}"
    ):
        _source(tiny_model, demo_data(), llm=n - 1).load(i)
    assert _source(tiny_model, demo_data(), vision=1024, llm=n).load(i).num_tokens == n  # at the limit: fine


def test_literal_vision_tokens_in_text_are_a_placeholder_mismatch(tiny_model, tmp_path):
    path = _write(
        tmp_path,
        [
            {
                "conversations": [
                    {"from": "human", "value": "what is <|image_pad|>?"},
                    {"from": "gpt", "value": "a token"},
                ]
            }
        ],
    )
    src = _source(tiny_model, jsonl_data(path, tmp_path))
    with pytest.raises(bad.BadSampleError, match=r"placeholder_mismatch.*1 image pad tokens for 0 image"):
        src.load(0)


def test_token_ids_must_match_the_tokenizer(tiny_model):
    wrong = replace(tiny_model, tokens=replace(tiny_model.tokens, image_token_id=99))
    with pytest.raises(
        ConfigError, match=r"model.tokens.image_token_id = 99: the tokenizer .* maps <\|image_pad\|> to"
    ):
        _source(wrong, demo_data())


def test_llava_needs_a_model_path(tiny_model):
    with pytest.raises(ConfigError, match=r"model\.path"):
        _source(replace(tiny_model, path=None), demo_data())


def test_transparent_png_is_composited_like_transformers(tiny_model, tmp_path):
    """skimage's horse.png is RGBA: pixels must equal HF's processor on the original file (exact)."""
    import skimage

    horse = Path(skimage.__file__).parent / "data" / "horse.png"
    assert Image.open(horse).mode == "RGBA"
    shutil.copy(horse, tmp_path / "horse.png")
    path = _write(
        tmp_path,
        [
            {
                "image": "horse.png",
                "conversations": [
                    {"from": "human", "value": "<image>What is it?"},
                    {"from": "gpt", "value": "A horse."},
                ],
            }
        ],
    )
    src = _source(tiny_model, jsonl_data(path, tmp_path))
    ref = src.processor.image_processor(images=[Image.open(horse)], return_tensors="pt")
    assert torch.equal(src.load(0).pixel_values, ref["pixel_values"])
