"""Checks of the ``data.*`` keys the loader reads, run with the rest of the config (``dhp plan``
reports them before anything starts): the engine and its prefetch, packing's row length, dataset
formats, video sampling bounds and the synthetic samples' token counts.

Two rules live here once and are also called where data is built, so the two can never disagree:
:func:`packed_row_tokens` (the packed LLM row length; the planner sizes rows with it) and
:func:`synthetic_sample_tokens` (a synthetic sample's LLM tokens: each image or video between its
two marker tokens, then the text).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from dhp.config.constants import DATA_ENGINES, DATASET_FORMATS
from dhp.config.issues import Issues
from dhp.errors import ConfigIssue

#: the consumer's ``seq_len`` key in messages when the caller does not name the module
CONSUMER_SEQ_KEY = "modules.<consumer>.seq_len"
#: every image and every video sits between <|vision_start|> and <|vision_end|> in the LLM's tokens
MARKERS_PER_VISUAL = 2


def packed_row_tokens(
    *, packing: bool, max_tokens: int, token_seq_len: int, seq_key: str = CONSUMER_SEQ_KEY
) -> tuple[int, list[ConfigIssue]]:
    """The packed row length (0: packing off) and why the setting is invalid, if it is.

    ``token_seq_len``: the consumer's (the loss module's) ``seq_len``, whose config key ``seq_key`` the
    messages name. ``data.max_tokens`` 0 means that ``seq_len``; a row shorter than the longest
    sample (that ``seq_len``) could not hold it; ``max_tokens`` without packing is a mistake.
    """
    if not packing:
        problems = []
        if max_tokens:
            why = "is set but data.packing is false"
            problems.append(
                ConfigIssue(
                    "data.max_tokens", max_tokens, why, "set data.packing=true, or drop data.max_tokens"
                )
            )
        return 0, problems
    row = max_tokens or token_seq_len
    if row < token_seq_len:
        return row, [
            ConfigIssue(
                "data.max_tokens",
                row,
                f"must be >= {seq_key}={token_seq_len} (the longest sample must fit a row)",
                f"set data.max_tokens >= {token_seq_len}, or lower {seq_key}",
            )
        ]
    return row, []


def synthetic_sample_tokens(
    synthetic: Any,
    *,
    spatial_merge_size: int,
    temporal_patch_size: int,
    text_tokens: int,
    audio_tokens: int = 0,
) -> int:
    """LLM tokens of one synthetic sample with ``text_tokens`` of text: every image's merged patches
    and every video's merged patches per temporal patch, each with its two markers, every audio's
    ``audio_tokens`` (its encoder's output for ``audio_frames``; 0: the model has no audio encoder,
    no audio is made) with its two markers, plus the text."""
    merged = synthetic.patches // spatial_merge_size**2
    video = synthetic.video_frames // temporal_patch_size * merged
    audios = synthetic.audios_per_sample if audio_tokens else 0
    return (
        synthetic.images_per_sample * (merged + MARKERS_PER_VISUAL)
        + synthetic.videos_per_sample * (video + MARKERS_PER_VISUAL)
        + audios * (audio_tokens + MARKERS_PER_VISUAL)
        + text_tokens
    )


def data_engine_problems(data: DictConfig) -> list[ConfigIssue]:
    """``data.engine`` known, ``data.prefetch_depth`` >= 1, ``data.cpus_per_worker`` >= 0."""
    issues = Issues()
    issues.one_of(data.engine, "data.engine", DATA_ENGINES)
    issues.check(data.prefetch_depth >= 1, "data.prefetch_depth", data.prefetch_depth,
                 "must be >= 1 (steps of samples in flight)", "use 2")  # fmt: skip
    issues.check(data.cpus_per_worker >= 0, "data.cpus_per_worker", data.cpus_per_worker,
                 "must be >= 0", "use 0 (unreserved) or 1")  # fmt: skip
    return issues.items


def _video(data: DictConfig, temporal: int, issues: Issues) -> None:
    for key in ("video_fps", "video_folder_fps", "video_min_pixels", "video_max_pixels"):
        issues.check(data[key] > 0, f"data.{key}", data[key], "must be > 0", "set a positive value")
    issues.check(
        data.video_min_pixels <= data.video_max_pixels,
        "data.video_min_pixels",
        data.video_min_pixels,
        f"must be <= data.video_max_pixels={data.video_max_pixels}",
        "lower video_min_pixels",
    )
    issues.check(
        data.video_max_frames >= temporal,
        "data.video_max_frames",
        data.video_max_frames,
        f"must hold at least one temporal patch (temporal_patch_size={temporal} frames)",
        f"use >= {temporal}",
    )


def _synthetic(syn: DictConfig, temporal: int, issues: Issues) -> None:
    issues.check(
        syn.text_tokens_max == 0 or syn.text_tokens_max >= syn.text_tokens,
        "data.synthetic.text_tokens_max",
        syn.text_tokens_max,
        f"must be 0 (every sample has text_tokens) or >= data.synthetic.text_tokens={syn.text_tokens}",
        f"use 0 or >= {syn.text_tokens}",
    )
    issues.check(syn.videos_per_sample >= 0, "data.synthetic.videos_per_sample", syn.videos_per_sample,
                 "must be >= 0", "use 0 for image-only samples")  # fmt: skip
    if syn.videos_per_sample > 0:
        issues.check(
            syn.video_frames > 0 and syn.video_frames % temporal == 0,
            "data.synthetic.video_frames",
            syn.video_frames,
            f"must be a positive multiple of temporal_patch_size={temporal}",
            f"use {max(temporal, syn.video_frames - syn.video_frames % temporal)}",
        )
        issues.check(syn.video_fps > 0, "data.synthetic.video_fps", syn.video_fps, "must be > 0", "e.g. 2.0")


def validate_data_keys(cfg: DictConfig, issues: Issues, *, consumer: str | None) -> None:
    """Every ``data.*`` key the loader reads, checked before anything starts (all problems at once).

    ``consumer``: the run's loss module (its family's last declared module; None: an unknown family,
    reported elsewhere), whose ``seq_len`` a packed row must hold."""
    data = cfg.data
    issues.items.extend(data_engine_problems(data))
    if consumer in cfg.modules:
        _, problems = packed_row_tokens(
            packing=data.packing,
            max_tokens=data.max_tokens,
            token_seq_len=cfg.modules[consumer].seq_len,
            seq_key=f"modules.{consumer}.seq_len",
        )
        issues.items.extend(problems)
    for i, ds in enumerate(data.datasets):
        issues.one_of(ds.format, f"data.datasets.{i}.format", DATASET_FORMATS)
    temporal = max(int(cfg.model.vision.temporal_patch_size), 1)
    _video(data, temporal, issues)
    _synthetic(data.synthetic, temporal, issues)
