"""Every data/train/metrics key is checked by the config validation (what ``dhp plan --dry-run``
runs), all problems at once, and the rules the loader and the planner use are the same functions."""

from __future__ import annotations

import pytest

from dhp.config.validate_data_keys import packed_row_tokens
from dhp.errors import ConfigError
from dhp.validation import load_config

pytestmark = pytest.mark.unit


def _paths(overrides: list[str], recipe: str = "tiny_vlm") -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides)
    return [i.path for i in info.value.issues]


def test_loader_keys_fail_at_validation_all_at_once() -> None:
    paths = _paths(["data.engine=bogus", "data.max_tokens=16", "data.prefetch_depth=0"])
    assert sorted(paths) == ["data.engine", "data.max_tokens", "data.prefetch_depth"]


def test_more_data_train_metrics_keys() -> None:
    paths = _paths(
        [
            "data.cpus_per_worker=-1",
            "data.packing=true",
            "data.max_tokens=16",  # shorter than modules.llm.seq_len
            "data.video_min_pixels=100000",  # > video_max_pixels
            "data.video_max_frames=1",  # < one temporal patch
            "data.synthetic.text_tokens_max=3",  # < text_tokens
            "train.seed=-1",
            "train.output_dir=' '",
            "train.router_aux_loss=per_step",  # step | micro_batch
            "metrics.wandb.project=''",
        ]
    )
    for want in (
        "data.cpus_per_worker",
        "data.max_tokens",
        "data.video_min_pixels",
        "data.video_max_frames",
        "data.synthetic.text_tokens_max",
        "train.seed",
        "train.output_dir",
        "train.router_aux_loss",
        "metrics.wandb.project",
    ):
        assert want in paths, (want, paths)


def test_synthetic_video_and_longest_text_count_against_seq_len() -> None:
    """The '+2 markers' count covers videos and the longest drawn text (the loader's own count)."""
    assert "modules.llm.seq_len" in _paths(["data.synthetic.text_tokens_max=1000"])
    assert "modules.llm.seq_len" in _paths(
        ["data.synthetic.videos_per_sample=4", "data.synthetic.video_frames=8"]
    )


def test_packed_row_rule() -> None:
    assert packed_row_tokens(packing=False, max_tokens=0, token_seq_len=64) == (0, [])
    assert packed_row_tokens(packing=True, max_tokens=0, token_seq_len=64) == (64, [])
    assert packed_row_tokens(packing=True, max_tokens=256, token_seq_len=64) == (256, [])
    _, problems = packed_row_tokens(packing=True, max_tokens=16, token_seq_len=64)
    assert problems and problems[0].path == "data.max_tokens"
