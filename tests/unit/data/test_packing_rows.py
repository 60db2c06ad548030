"""Packing on the data side: first-fit rows, the packed batch layout, its inverse and the config checks."""

from __future__ import annotations

import pytest
import torch

from dhp.config.schema import DataConfig
from dhp.data.batch import IGNORE_INDEX, IMAGE, Sample
from dhp.data.packing import is_packed, pack, pack_rows, packed_max_tokens, unpack
from dhp.errors import ConfigError, DataError

pytestmark = pytest.mark.unit


def _sample(k: int, n: int, n_img_tokens: int = 0) -> Sample:
    ids = torch.arange(100 * k, 100 * k + n)
    types = torch.zeros(n, dtype=torch.long)
    types[1 : 1 + n_img_tokens] = IMAGE
    grid = torch.tensor([[1, 2, 2 * n_img_tokens]]) if n_img_tokens else None  # merge 2: 4 patches/token
    pixels = torch.full((4 * n_img_tokens, 3), float(k)) if n_img_tokens else None
    return Sample(f"s{k}", ids, ids.clone(), types, pixel_values=pixels, image_grid_thw=grid)


def test_pack_rows_first_fit_in_order_and_too_long() -> None:
    # longest first: 7 -> row 0, 6 -> row 1, 5 -> row 2, 3 -> row 0, 2 -> row 1 (first with room)
    assert pack_rows([5, 7, 3, 6, 2], max_tokens=10) == [[1, 2], [3, 4], [0]]
    with pytest.raises(DataError, match=r"data\.max_tokens=4"):
        pack_rows([3, 5], max_tokens=4)


def test_pack_layout_labels_images_and_unpack_roundtrip() -> None:
    samples = [_sample(0, 5, 2), _sample(1, 7), _sample(2, 3, 1), _sample(3, 4, 1)]
    b = pack(samples, max_tokens=10, pad_token_id=-1)
    # first-fit decreasing rows: [s1, s2] (10 tokens), [s0, s3] (9), right-padded to the longest row
    assert b.sample_ids == ["s1+s2", "s0+s3"] and b.input_ids.shape == (2, 10)
    assert b.attention_mask[0].tolist() == [1] * 7 + [2] * 3
    assert b.attention_mask[1].tolist() == [1] * 5 + [2] * 4 + [0]
    assert b.labels[0, 7] == IGNORE_INDEX and b.labels[0, 0] == IGNORE_INDEX  # every sample's first label
    assert b.num_label_tokens == sum(s.num_label_tokens for s in samples)
    assert b.pixel_values[:, 0].unique_consecutive().tolist() == [2.0, 0.0, 3.0]  # row-major: s2, s0, s3
    assert is_packed(b.attention_mask) and not is_packed(torch.ones(2, 3, dtype=torch.long))
    back = unpack(b)
    assert [u.sample_ids[0] for u in back] == ["s1", "s2", "s0", "s3"]
    for u, s in zip(back, [samples[i] for i in (1, 2, 0, 3)], strict=True):
        assert torch.equal(u.input_ids[0], s.input_ids) and u.attention_mask.all()
        assert (u.image_grid_thw is None) == (s.image_grid_thw is None)
        if s.pixel_values is not None:
            assert torch.equal(u.pixel_values, s.pixel_values)


def test_packing_config_checks() -> None:
    assert packed_max_tokens(DataConfig(), token_seq_len=128) == 0
    assert packed_max_tokens(DataConfig(packing=True), token_seq_len=128) == 128
    with pytest.raises(ConfigError, match=r"data\.max_tokens"):
        packed_max_tokens(DataConfig(packing=True, max_tokens=64), token_seq_len=128)
    with pytest.raises(ConfigError, match=r"data\.packing"):
        packed_max_tokens(DataConfig(max_tokens=256), token_seq_len=128)
