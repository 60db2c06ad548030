"""Video data: the shipped clips through the real processor (frames folder and MP4), temporal patch
layout, time sampling, and ``dhp data check`` naming an unreadable file, an empty clip and a
placeholder/token mismatch."""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import DEMO

from dhp.config.schema import DataConfig, DatasetEntry
from dhp.data.batch import IMAGE, VIDEO
from dhp.data.check import check_data
from dhp.data.source import build_source
from dhp.data.video import VideoSpec, sample_indices, temporal_patches

pytestmark = pytest.mark.unit
SPEC = VideoSpec(
    4.0, 8, 4.0, 3136, 12544, patch_size=14, merge=2, temporal_patch_size=2, mean=(0, 0, 0), std=(1, 1, 1)
)


def _video_data(path, root, **over) -> DataConfig:
    entry = DatasetEntry(name="v", path=str(path), image_root=str(root))
    data = DataConfig(kind="llava", datasets=[entry], video_fps=4.0, video_folder_fps=4.0, video_max_frames=8)
    return replace(data, video_min_pixels=3136, video_max_pixels=12544, **over)


def test_sampling_by_time_and_patch_layout() -> None:
    # 8 frames at 4 fps = 2 s: 2 fps sampling keeps 4 frames, evenly spread, at 2 fps
    keep, fps = sample_indices(8, native_fps=4.0, spec=replace(SPEC, fps=2.0))
    assert keep == [0, 2, 5, 7] and fps == 2.0
    # max_frames caps (rounded down to whole temporal patches) and the sampled fps drops with it
    keep, fps = sample_indices(40, native_fps=4.0, spec=replace(SPEC, max_frames=5))
    assert len(keep) == 4 and fps == 0.4
    # temporal patch (t, y, x) holds frames 2t and 2t+1 at (y, x): columns (C, T, P, P)
    frames = np.arange(4 * 3 * 28 * 56, dtype=np.float32).reshape(4, 3, 28, 56)
    rows, grid = temporal_patches(frames, spec=SPEC)
    assert grid == (2, 2, 4) and rows.shape == (16, 3 * 2 * 14 * 14)
    row = rows[8].reshape(3, 2, 14, 14)  # t=1, first merge block, first patch
    assert torch.equal(row[:, 0], torch.from_numpy(frames[2, :, :14, :14]))
    assert torch.equal(row[:, 1], torch.from_numpy(frames[3, :, :14, :14]))


def test_shipped_clips_process_with_ordered_items(tiny_model) -> None:
    pytest.importorskip("av")
    src, _, _ = build_source(
        data=_video_data(DEMO / "videos.jsonl", DEMO / "images"),
        model=tiny_model,
        patch_seq_len=4096,
        token_seq_len=2048,
        seed=0,
    )
    samples = [src.load(i) for i in range(len(src))]
    folder = samples[0]  # clips/ball: 8 frames at 4 fps -> 4 temporal patches, 0.5 s each
    assert folder.image_grid_thw.tolist() == [[4, 6, 8]] and folder.second_per_grid_ts.tolist() == [0.5]
    assert int((folder.mm_token_type_ids == VIDEO).sum()) == 4 * 6 * 8 // 4
    assert folder.pixel_values.shape[0] == 4 * 6 * 8
    both = samples[3]  # a photo then the MP4 clip: items in token order, image first
    types = both.mm_token_type_ids.tolist()
    assert types.index(IMAGE) < types.index(VIDEO)
    assert both.image_grid_thw[1].tolist() == [4, 6, 8] and both.image_grid_thw[0, 0] == 1
    assert both.pixel_values.shape[0] == int(both.image_grid_thw.prod(dim=1).sum())
    # the MP4 decodes to the same frames as the PNG folder, up to the codec's loss
    mp4 = both.pixel_values[-folder.pixel_values.shape[0] :]
    assert (mp4 - folder.pixel_values).abs().mean() < 0.1


def test_data_check_names_bad_videos(tiny_model, tmp_path) -> None:
    root = tmp_path / "images"
    shutil.copytree(DEMO / "images" / "clips", root / "clips")
    (root / "clips" / "empty").mkdir()
    (root / "clips" / "broken.mp4").write_bytes(b"not a video at all")
    lines = [
        '{"video": "clips/ball", "conversations": [{"from": "human", "value": "<video> ok"}, {"from": "gpt", "value": "a"}]}',
        '{"video": "clips/empty", "conversations": [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "b"}]}',
        '{"video": "clips/broken.mp4", "conversations": [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "c"}]}',
        '{"video": "clips/square", "conversations": [{"from": "human", "value": "two <video> <video>"}, {"from": "gpt", "value": "d"}]}',
        '{"video": "clips/sunset", "conversations": [{"from": "human", "value": "<video> <|video_pad|>"}, {"from": "gpt", "value": "e"}]}',
    ]
    (tmp_path / "v.jsonl").write_text("\n".join(lines) + "\n")
    data = _video_data(tmp_path / "v.jsonl", root, on_bad_sample="skip")
    report = check_data(data=data, model=tiny_model, patch_seq_len=4096, token_seq_len=2048)
    assert report.num_good == 1 and report.num_bad == 4
    assert report.bad_counts == {"empty_video": 1, "corrupt_video": 1, "placeholder_mismatch": 2}
    assert "v.jsonl:2" in report.bad_examples["empty_video"][0]
    assert "broken.mp4" in report.bad_examples["corrupt_video"][0]
