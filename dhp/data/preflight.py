"""Cheap existence checks of the configured datasets (``dhp plan --dry-run``): no record is read.

Every dataset's ``path`` must name something (a file, a folder, or a glob / brace range with at least
one match) and every ``image_root`` must be a folder. All problems are reported at once.
"""

from __future__ import annotations

import glob

from dhp.config.schema import DataConfig
from dhp.data.dataset_info import resolve_info
from dhp.data.llava import resolve_path
from dhp.data.wds import expand_shards
from dhp.errors import ConfigError, DataError


def _exists(path: str) -> bool:

    if "{" in path:
        shards = expand_shards(path)
        return bool(shards) and all(s.is_file() for s in shards)
    if any(c in path for c in "*?["):
        return bool(glob.glob(path))
    return resolve_path(path, key="data.datasets[].path").exists()


def missing_data_paths(data: DataConfig) -> list[str]:
    """One line per dataset file or image root that does not exist (empty: all there)."""

    if data.kind != "llava":
        return []
    problems = []

    for i, raw in enumerate(data.datasets):
        try:
            entry = resolve_info(raw)
        except ConfigError as e:
            problems.append(f"data.datasets[{i}] ({raw.name}): {e}")
            continue
        if not _exists(entry.path):
            problems.append(f"data.datasets[{i}] ({entry.name}).path = {entry.path!r} does not exist")
        root = entry.image_root or entry.media_dir
        if root and not resolve_path(root, key="image_root").is_dir():
            problems.append(f"data.datasets[{i}] ({entry.name}).image_root = {root!r} is not a directory")
    return problems


def check_data_paths(data: DataConfig) -> None:
    """Raise DataError listing every missing dataset path and image root (see :func:`missing_data_paths`)."""
    problems = missing_data_paths(data)
    if problems:
        lines = "\n  ".join(problems)
        raise DataError(
            f"the configured data is not reachable from this machine:\n  {lines}\n"
            "Fix: correct the paths, or mount the shared storage they live on (docs/DATA.md)"
        )


__all__ = ["check_data_paths", "missing_data_paths"]
