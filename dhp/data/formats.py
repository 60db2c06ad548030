"""Which reader a dataset entry gets: ``format`` as configured, or detected from its path.

``auto``: ``.json``/``.jsonl`` -> JSON records (LLaVA or messages, told apart by their keys);
``.parquet``/``.arrow`` (or a folder of them) -> :class:`~dhp.data.tabular.TabularDataset`;
``.tar``, a brace range or a folder of shards -> :class:`~dhp.data.wds.WebDataset`.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Protocol

from dhp.config.constants import DATASET_FORMATS
from dhp.config.schema import DatasetEntry
from dhp.data.dataset_info import resolve_info, use_audio_in_video
from dhp.data.llava import LlavaDataset, Record, resolve_path
from dhp.data.wds import WebDataset
from dhp.errors import ConfigError, ConfigIssue

FORMATS = DATASET_FORMATS


class Dataset(Protocol):
    """One configured dataset: ``len``, a location per index, a validated record per index."""

    name: str

    def __len__(self) -> int: ...

    def location(self, index: int) -> str: ...

    def record(self, index: int) -> Record: ...


def detect_format(entry: DatasetEntry) -> str:
    """``llava`` (any JSON/JSONL), ``parquet`` or ``webdataset`` for an ``auto`` entry."""
    if "{" in entry.path or entry.path.endswith(".tar"):
        return "webdataset"
    path = resolve_path(entry.path, key=f"data.datasets[{entry.name}].path")
    if path.suffix in (".parquet", ".arrow"):
        return "parquet"
    if path.is_dir():
        suffixes = {p.suffix for p in path.rglob("*")}
    elif any(c in entry.path for c in "*?["):
        suffixes = {Path(p).suffix for p in glob.glob(str(path))}
    else:
        suffixes = set()
    if ".tar" in suffixes:
        return "webdataset"
    if suffixes & {".parquet", ".arrow"}:
        return "parquet"
    return "llava"


def open_dataset(
    entry: DatasetEntry,
    *,
    allow_outside_root: bool,
    restrict_to: tuple[Path, ...] = (),
    audio_in_video: bool = False,
) -> Dataset:
    """The reader of ``entry`` (DataError when its files are missing or unreadable). An entry with
    ``info`` is first read from that ``dataset_info.json`` (:mod:`dhp.data.dataset_info`), including
    its dataset-level ``use_audio_in_video``, carried onto each record by the JSON and parquet readers
    (WebDataset members cannot be videos, so there it has nothing to apply to); ``audio_in_video``:
    the run's ``data.use_audio_in_video``, the default of entries and records that do not say."""

    audio_in_video = use_audio_in_video(entry, default=audio_in_video)
    entry = resolve_info(entry)
    if entry.format not in FORMATS:
        raise ConfigError(
            [
                ConfigIssue(
                    f"data.datasets[{entry.name}].format",
                    entry.format,
                    f"must be one of {FORMATS}",
                    "pick one",
                )
            ]
        )
    fmt = entry.format if entry.format in ("parquet", "webdataset") else detect_format(entry)
    if fmt == "parquet":  # pyarrow loads only for parquet/arrow datasets
        from dhp.data.tabular import TabularDataset

        return TabularDataset(
            entry,
            allow_outside_root=allow_outside_root,
            restrict_to=restrict_to,
            use_audio_in_video=audio_in_video,
        )
    if fmt == "webdataset":
        return WebDataset(entry, allow_outside_root=allow_outside_root)
    return LlavaDataset(
        entry,
        allow_outside_root=allow_outside_root,
        restrict_to=restrict_to,
        use_audio_in_video=audio_in_video,
    )
