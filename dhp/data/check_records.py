"""``dhp data check data.path=FILE`` without a recipe: the checks that need no tokenizer.

Every record is read and validated by its reader (layout, turns, tags against media), each image is
opened and decoded in full (the same guards as training), and each video path must exist. Each audio
file (and, with ``use_audio_in_video``, each video's audio track) is measured from its header, not
decoded: unreadable, empty and too-long clips are bad records. Counted: records, images, videos and
audio files per sample, audio files, video audio tracks and their seconds, bad records by reason,
ignored keys. Token counts need the model's tokenizer and processor: give a recipe (``conf=...``)
for those; audio tokens need the family's numbers (``audio_tokens``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

from dhp.config.schema import DataConfig
from dhp.data import bad
from dhp.data.audio import RecordAudio, record_audio
from dhp.data.check import DataReport, audio_fields
from dhp.data.formats import open_dataset
from dhp.data.images import open_image
from dhp.data.llava import resolve_path


def check_records(
    data: DataConfig,
    *,
    max_audio_seconds: float = math.inf,
    audio_tokens: Callable[[float], int] | None = None,
) -> DataReport:
    """Read every record of ``data.datasets`` once, without a model: a :class:`DataReport` with
    image/video/audio counts and bad records (token and patch fields left empty). A clip longer than
    ``max_audio_seconds`` is ``audio_too_long``; ``audio_tokens(seconds)`` (the model family's count)
    fills ``audio_tokens``, else it stays None (not shown)."""
    restrict = tuple(
        Path(os.path.realpath(resolve_path(r, key="data.restrict_media_to"))) for r in data.restrict_media_to
    )
    log = bad.BadSampleLog(keep=5)
    images: dict[str, int] = {}
    videos: dict[str, int] = {}
    audios: dict[str, int] = {}
    clips: list[RecordAudio] = []
    total = good = 0
    ignored: dict[str, list[str]] = {}
    for entry in data.datasets:
        ds = open_dataset(
            entry,
            allow_outside_root=data.allow_outside_root,
            restrict_to=restrict,
            audio_in_video=data.use_audio_in_video,
        )
        for i in range(len(ds)):
            total += 1
            try:
                rec = ds.record(i)
                for ref in rec.images:
                    open_image(ref, loc=rec.location)
                for v in rec.videos:
                    if not v.exists():
                        raise bad.BadSampleError(
                            location=rec.location,
                            reason=bad.MISSING_FILE,
                            detail=f"video {v} does not exist",
                            fix="restore the file or fix the path",
                        )
                clip = record_audio(rec, max_seconds=max_audio_seconds)
            except bad.BadSampleError as err:
                log.add(err)
                continue
            good += 1
            images[str(len(rec.images))] = images.get(str(len(rec.images)), 0) + 1
            videos[str(len(rec.videos))] = videos.get(str(len(rec.videos)), 0) + 1
            audios[str(len(rec.audios))] = audios.get(str(len(rec.audios)), 0) + 1
            clips.append(clip)
        if ds.ignored.keys:
            ignored[ds.name] = sorted(ds.ignored.keys)
    return DataReport(
        num_records=total,
        num_good=good,
        on_bad_sample=data.on_bad_sample,
        patch_histogram={},
        text_tokens_percentiles={},
        tokens_percentiles={},
        images_per_sample=dict(sorted(images.items(), key=lambda kv: int(kv[0]))),
        total_patches=0,
        bad_counts=dict(sorted(log.counts.items())),
        bad_examples={k: log.examples[k] for k in sorted(log.examples)},
        videos_per_sample=dict(sorted(videos.items(), key=lambda kv: int(kv[0]))),
        ignored_keys=ignored,
        **audio_fields(audios, clips, audio_tokens=audio_tokens),
    )
