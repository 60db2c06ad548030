"""Pure sharding math of the vision encoder's Ulysses SP: cuts, balance, coverage, edge cases, errors."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from transformers import Qwen2_5_VLVisionConfig
from transformers.vision_utils import get_vision_window_index

from dhp.errors import ConfigError, DataError
from dhp.models.qwen2_5_vl.sp_shard import SPLIT_SIZES_KWARG, balance_cuts, shard_vision_batch

pytestmark = pytest.mark.unit

ARCH = Qwen2_5_VLVisionConfig(
    depth=4, hidden_size=32, num_heads=4, intermediate_size=64, fullatt_block_indexes=[1, 3], window_size=112
)
ROW = 3 * 2 * 14 * 14


def _pixels(grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    thw = torch.tensor(grids, dtype=torch.long)
    rows = int(thw.prod(-1).sum())
    # row i holds the value i everywhere, so a shard's rows name the patches it received
    return torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, ROW).contiguous(), thw


def _brute_bottleneck(sizes: list[int], parts: int) -> int:
    n, best = len(sizes), sum(sizes)
    for cuts in itertools.combinations_with_replacement(range(n + 1), parts - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_balance_cuts_is_optimal_and_contiguous() -> None:
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([16, 32, 48, 64]) for _ in range(rng.randint(1, 9))]
        parts = rng.randint(1, 5)
        cuts = balance_cuts(sizes, parts)
        assert len(cuts) == parts + 1 and cuts[0] == 0 and cuts[-1] == len(sizes)
        assert all(a <= b for a, b in itertools.pairwise(cuts)), cuts
        loads = [sum(sizes[a:b]) for a, b in itertools.pairwise(cuts)]
        assert max(loads) == _brute_bottleneck(sizes, parts), (sizes, parts, cuts)
        if len(sizes) >= parts:  # no empty rank while there are windows enough
            assert min(loads) > 0, (sizes, parts, cuts)


def test_balance_cuts_spreads_equal_windows_evenly() -> None:
    assert balance_cuts([64] * 8, 4) == [0, 2, 4, 6, 8]
    # 6 windows on 4 ranks: bottleneck 2 windows; cuts nearest the ideal prefixes (ties go later)
    assert balance_cuts([64] * 6, 4) == [0, 2, 3, 5, 6]


def test_balance_cuts_fewer_windows_than_parts_leaves_empty_ranks() -> None:
    cuts = balance_cuts([64], 2)
    assert sorted(b - a for a, b in itertools.pairwise(cuts)) == [0, 1]
    cuts = balance_cuts([64, 32], 4)
    assert sorted(b - a for a, b in itertools.pairwise(cuts)) == [0, 0, 1, 1]


@pytest.mark.parametrize(
    ("grids", "sp"),
    [
        ([(1, 16, 24)], 2),
        ([(1, 16, 24)], 4),
        ([(1, 16, 24), (1, 8, 12)], 3),
        ([(1, 8, 8)], 2),  # one window, two ranks: one rank has no tokens
        ([(1, 8, 8), (1, 4, 8)], 4),  # two windows, four ranks
        ([(2, 8, 12)], 2),  # two frames: windows per frame
        ([(1, 30, 42), (1, 6, 10)], 4),  # partial edge windows
    ],
)
def test_shards_cover_every_patch_once_in_window_order(grids, sp) -> None:
    pixels, thw = _pixels(grids)
    shards = shard_vision_batch(pixels, thw, sp_size=sp, arch=ARCH)
    window_index, cu_window = get_vision_window_index(thw, 2, 112, 14)
    assert len(shards) == sp
    # token_index over ranks is a permutation of all merged tokens, each ascending
    tokens = torch.cat([s.token_index for s in shards])
    assert torch.equal(tokens.sort().values, torch.arange(window_index.numel()))
    assert all(torch.equal(s.token_index, s.token_index.sort().values) for s in shards)
    # rank slices concatenated in rank order are the global window order
    assert torch.equal(torch.cat([s.token_index[s.window_index] for s in shards]), window_index)
    # each rank gets exactly its units' pixel rows (original order), 4 patches per merged token
    for s in shards:
        want_rows = (s.token_index[:, None] * 4 + torch.arange(4)).reshape(-1).float()
        assert torch.equal(s.pixel_values[:, 0], want_rows)
        assert s.position_ids.shape == (s.num_patches, 2)
        assert s.split_sizes[s.rank] == s.num_patches
        assert int(s.cu_window_seqlens[-1]) == s.num_patches
        assert s.num_patches % 4 == 0
    # cuts fall on window boundaries: each rank's windows are global windows
    boundaries = set(cu_window.tolist())
    offset = 0
    for s in shards:
        assert {offset + int(c) for c in s.cu_window_seqlens} <= boundaries
        offset += s.num_patches
    assert offset == pixels.shape[0]


def test_balance_by_patch_count_over_all_images() -> None:
    pixels, thw = _pixels([(1, 16, 24), (1, 16, 24)])  # 12 windows of 64 patches
    shards = shard_vision_batch(pixels, thw, sp_size=4, arch=ARCH)
    assert [s.num_patches for s in shards] == [192, 192, 192, 192]
    pixels, thw = _pixels([(1, 16, 24), (1, 8, 12)])  # windows 6x64 + 64 + 32 = 480 patches
    shards = shard_vision_batch(pixels, thw, sp_size=2, arch=ARCH)
    assert max(s.num_patches for s in shards) == 256  # optimal at window granularity


def test_rank_without_tokens_has_empty_but_valid_shard() -> None:
    pixels, thw = _pixels([(1, 8, 8)])
    shards = shard_vision_batch(pixels, thw, sp_size=2, arch=ARCH)
    empty = [s for s in shards if s.num_patches == 0]
    assert len(empty) == 1
    e = empty[0]
    assert e.pixel_values.shape == (0, ROW) and e.token_index.numel() == 0 and e.window_index.numel() == 0
    assert e.split_sizes == (0, 64) or e.split_sizes == (64, 0)
    assert e.forward_kwargs()[SPLIT_SIZES_KWARG] == e.split_sizes


def test_sp1_is_the_whole_batch_with_hf_metadata() -> None:
    pixels, thw = _pixels([(1, 16, 24), (1, 8, 12)])
    (shard,) = shard_vision_batch(pixels, thw, sp_size=1, arch=ARCH)
    window_index, cu_window = get_vision_window_index(thw, 2, 112, 14)
    assert torch.equal(shard.pixel_values, pixels)
    assert torch.equal(shard.token_index, torch.arange(window_index.numel()))
    assert torch.equal(shard.window_index, window_index)
    assert torch.equal(shard.cu_window_seqlens, cu_window)
    assert SPLIT_SIZES_KWARG not in shard.forward_kwargs()


def test_sp1_shard_forward_equals_stock_forward() -> None:
    from dhp.models import get_family

    family = get_family("qwen2_5_vl")
    hf = family.hf_config(family.tiny_model_config())
    module = family.build_module("vision", hf, device="cpu", dtype=torch.float32)
    pixels = torch.randn(int(torch.tensor([[1, 16, 24], [1, 8, 12]]).prod(-1).sum()), ROW)
    thw = torch.tensor([[1, 16, 24], [1, 8, 12]])
    (shard,) = shard_vision_batch(pixels, thw, sp_size=1, arch=hf.vision_config)
    with torch.no_grad():
        assert torch.equal(
            module(**shard.forward_kwargs())["image_embeds"], module(pixels, thw)["image_embeds"]
        )


def test_errors_name_the_problem() -> None:
    pixels, thw = _pixels([(1, 8, 8)])
    with pytest.raises(ConfigError, match=r"modules\.vision\.parallel\.sp"):
        shard_vision_batch(pixels, thw, sp_size=0, arch=ARCH)
    with pytest.raises(DataError, match="spatial_merge_size"):
        shard_vision_batch(pixels, torch.tensor([[1, 8, 7]]), sp_size=2, arch=ARCH)
    with pytest.raises(DataError, match="pixel_values has shape"):
        shard_vision_batch(pixels[:-4], thw, sp_size=2, arch=ARCH)
    with pytest.raises(DataError, match="image_grid_thw has shape"):
        shard_vision_batch(pixels, thw[0], sp_size=2, arch=ARCH)
    with pytest.raises(DataError, match="required"):
        shard_vision_batch(None, None, sp_size=2, arch=ARCH)
