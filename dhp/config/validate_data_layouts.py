"""Checks of the keys that say how a dataset's records are laid out and where its media may live:
``data.datasets[].formatting/columns/tags/info/media_dir`` and ``data.restrict_media_to``,
``data.path``/``data.format``. Pure: only the ``info`` file's existence is looked at."""

from __future__ import annotations

import os

from omegaconf import DictConfig

from dhp.config.issues import Issues

# LLaMA-Factory's dataset_info.json vocabulary (dhp.data.records reads these)
FORMATTINGS = ("", "sharegpt", "alpaca")
COLUMNS = (
    *("messages", "system", "images", "videos", "audios", "tools"),  # sharegpt
    *("prompt", "query", "response", "history"),  # alpaca
)
TAGS = (
    "role_tag",
    "content_tag",
    "user_tag",
    "assistant_tag",
    "system_tag",
    "observation_tag",
    "function_tag",
)
FORMATS = ("auto", "llava", "messages", "parquet", "webdataset")


def validate_data_layouts(data: DictConfig, issues: Issues) -> None:
    """Every problem of the layout and media-path keys, added to ``issues``."""
    issues.one_of(data.format, "data.format", FORMATS)
    for i, ds in enumerate(data.datasets):
        key = f"data.datasets.{i}"
        issues.check(
            bool(ds.path or ds.info),
            f"{key}.path",
            ds.path,
            "a dataset needs a path (or info: a dataset_info.json and the entry's name)",
            "set path: FILE, or info: DIR/dataset_info.json",
        )
        issues.check(
            not (ds.image_root and ds.media_dir and ds.image_root != ds.media_dir),
            f"{key}.media_dir",
            ds.media_dir,
            f"differs from image_root={ds.image_root!r} (two names of one setting)",
            "set one of them",
        )
        issues.one_of(ds.formatting, f"{key}.formatting", FORMATTINGS)
        for col in ds.columns:
            issues.check(
                col in COLUMNS,
                f"{key}.columns.{col}",
                ds.columns[col],
                f"must be one of {COLUMNS}",
                "remove it",
            )
        for tag in ds.tags:
            issues.check(
                tag in TAGS, f"{key}.tags.{tag}", ds.tags[tag], f"must be one of {TAGS}", "remove it"
            )
        if ds.info and not ds.info.startswith("pkg://"):
            issues.check(
                os.path.isfile(os.path.expanduser(ds.info)),
                f"{key}.info",
                ds.info,
                "file does not exist",
                "point info at a LLaMA-Factory dataset_info.json",
            )
    for i, root in enumerate(data.restrict_media_to):
        issues.check(
            os.path.isabs(os.path.expanduser(root)) or root.startswith("pkg://"),
            f"data.restrict_media_to.{i}",
            root,
            "must be an absolute path (a shared cluster's allowed media roots)",
            "write the root as /mnt/...",
        )
