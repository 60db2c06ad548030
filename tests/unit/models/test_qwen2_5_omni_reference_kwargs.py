"""Qwen2.5-Omni's reference call (``dhp verify``): the thinker's keyword names, and its one
``use_audio_in_video`` per call read from the tokens."""

from __future__ import annotations

import pytest
import torch

from dhp.data.batch import AUDIO, TEXT, VIDEO
from dhp.errors import DataError
from dhp.models import get_family

pytestmark = pytest.mark.unit

T, V, A = TEXT, VIDEO, AUDIO
INTERLEAVED = [T, T, V, V, A, A, A, V, A, T]  # a video with its audio track
VIDEO_ONLY = [T, V, V, V, T, T, T, T, T, T]
AUDIO_ONLY = [T, T, A, A, A, T, T, T, T, T]  # a standalone audio between its (text) start/end tokens


def _kwargs(*rows: list[int]) -> dict:
    types_ = torch.tensor(rows)
    inputs = {
        "input_ids": torch.zeros_like(types_),
        "mm_token_type_ids": types_,
        "second_per_grid_ts": torch.tensor([1.0]),
        "pixel_values": None,
    }
    return get_family("qwen2_5_omni").reference_kwargs(inputs)


def test_names_and_flag_read_from_the_tokens():
    out = _kwargs(INTERLEAVED, AUDIO_ONLY)
    assert out["use_audio_in_video"] is True and "mm_token_type_ids" not in out and "pixel_values" not in out
    assert torch.equal(out["video_second_per_grid"], torch.tensor([1.0])) and "second_per_grid_ts" not in out
    assert _kwargs(VIDEO_ONLY, AUDIO_ONLY)["use_audio_in_video"] is False


def test_a_batch_mixing_videos_with_and_without_their_track_is_refused():
    with pytest.raises(DataError, match="one use_audio_in_video per call"):
        _kwargs(INTERLEAVED, VIDEO_ONLY)
