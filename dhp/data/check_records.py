"""``dhp data check data.path=FILE`` without a recipe: the checks that need no tokenizer.

Every record is read and validated by its reader (layout, turns, tags against media), each image is
opened and decoded in full (the same guards as training), and each video path must exist. Counted:
records, images and videos per sample, bad records by reason, ignored keys. Token counts need the
model's tokenizer and processor: give a recipe (``conf=...``) for those.
"""

from __future__ import annotations

import os
from pathlib import Path

from dhp.config.schema import DataConfig
from dhp.data import bad
from dhp.data.check import DataReport
from dhp.data.formats import open_dataset
from dhp.data.images import open_image
from dhp.data.llava import resolve_path


def check_records(data: DataConfig) -> DataReport:
    """Read every record of ``data.datasets`` once, without a model: a :class:`DataReport` with
    image/video counts and bad records (token and patch fields left empty)."""
    restrict = tuple(
        Path(os.path.realpath(resolve_path(r, key="data.restrict_media_to"))) for r in data.restrict_media_to
    )
    log = bad.BadSampleLog(keep=5)
    images: dict[str, int] = {}
    videos: dict[str, int] = {}
    total = good = 0
    ignored: dict[str, list[str]] = {}
    for entry in data.datasets:
        ds = open_dataset(entry, allow_outside_root=data.allow_outside_root, restrict_to=restrict)
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
            except bad.BadSampleError as err:
                log.add(err)
                continue
            good += 1
            images[str(len(rec.images))] = images.get(str(len(rec.images)), 0) + 1
            videos[str(len(rec.videos))] = videos.get(str(len(rec.videos)), 0) + 1
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
    )
