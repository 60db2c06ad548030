"""A LLaMA-Factory ``dataset_info.json`` read directly: ``{info: path/dataset_info.json, name: mllm_demo}``.

The file maps dataset names to entries; dhp reads an entry's ``file_name`` (relative to the file's
folder, as LLaMA-Factory's ``dataset_dir``), ``formatting``, ``columns``, ``tags`` and ``media_dir``.
Media paths are relative to the entry's ``media_dir`` (relative to the folder), else the folder
(LLaMA-Factory's default ``media_dir``), unless the dhp entry sets ``image_root``/``media_dir``.
LLaMA-Factory falls back to the path as written (the working directory) when a media file is not
under ``media_dir``; dhp does not (a run must read the same file on every node): such a record is
``missing_file``. The dhp entry's own ``columns``/``tags`` win over the file's, key by key.
An entry's ``use_audio_in_video: true`` (a dhp key; LLaMA-Factory and ms-swift set it per run) is the
dataset's default for records without their own ``use_audio_in_video`` (:func:`use_audio_in_video`).
Hub entries (``hf_hub_url``, ``ms_hub_url``, ``script_url``) are refused: download the data and point
``file_name`` (or ``path``) at it. Other entry keys (``ranking``, ``split``, ``num_samples``, ...) are
ignored and listed once in the log.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields, replace
from pathlib import Path

from dhp.config.schema import DatasetEntry
from dhp.data.bad import json_error
from dhp.data.llava import resolve_path
from dhp.data.records import USE_AUDIO_IN_VIDEO
from dhp.errors import ConfigError, ConfigIssue

log = logging.getLogger("dhp.data")
READ = ("file_name", "formatting", "columns", "tags", "media_dir", USE_AUDIO_IN_VIDEO)
HUB = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")


def plain_entry(entry) -> DatasetEntry:
    """A ``DatasetEntry`` dataclass copy of a config node (or of a dataclass)."""
    out = {}
    for f in fields(DatasetEntry):
        value = getattr(entry, f.name)
        out[f.name] = dict(value) if f.name in ("columns", "tags") else value
    return DatasetEntry(**out)


def _issue(entry, key: str, value: object, rule: str, fix: str) -> ConfigError:
    return ConfigError([ConfigIssue(f"data.datasets[{entry.name}].{key}", value, rule, fix)])


def resolve_info(entry) -> DatasetEntry:
    """``entry`` with ``path``, ``formatting``, ``columns``, ``tags`` (and ``media_dir``) read from
    its ``info`` file; ``entry`` unchanged (as a dataclass) when it has none. ConfigError when the
    file or the name is missing, or the entry points at a hub."""
    plain = plain_entry(entry)
    if not plain.info:
        return plain
    path, spec = _spec(plain)
    ignored = sorted(set(spec) - set(READ) - set(HUB))
    if ignored:
        log.warning("dataset %r: ignoring %s entry key(s) %s", plain.name, path.name, ignored)
    folder = path.parent
    file_path = plain.path or str(folder / str(spec["file_name"]))
    return replace(
        plain,
        path=file_path,
        formatting=plain.formatting or str(spec.get("formatting", "")),
        columns={**dict(spec.get("columns") or {}), **plain.columns},
        tags={**dict(spec.get("tags") or {}), **plain.tags},
        media_dir=plain.media_dir
        or ("" if plain.image_root else str(folder / str(spec.get("media_dir") or ""))),
    )


def use_audio_in_video(entry, *, default: bool = False) -> bool:
    """The ``use_audio_in_video`` of ``entry``'s ``dataset_info.json`` entry (``default``, the run's
    ``data.use_audio_in_video``, without ``info`` or the key); ConfigError when it is not a JSON
    boolean."""
    plain = plain_entry(entry)
    if not plain.info:
        return default
    path, spec = _spec(plain)
    value = spec.get(USE_AUDIO_IN_VIDEO, default)
    if not isinstance(value, bool):
        raise _issue(
            plain,
            "info",
            str(path),
            f"entry {plain.name!r} has {USE_AUDIO_IN_VIDEO} = {value!r}, not a boolean",
            f"write {USE_AUDIO_IN_VIDEO}: true or false",
        )
    return value


def _spec(plain: DatasetEntry) -> tuple[Path, dict]:
    """The ``info`` file's path and the entry ``plain.name`` in it (ConfigError when missing or hub-only)."""
    path = resolve_path(plain.info, key=f"data.datasets[{plain.name}].info")
    if not path.is_file():
        raise _issue(plain, "info", plain.info, "file does not exist", "point info at a dataset_info.json")
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise _issue(
            plain, "info", str(path), f"is not UTF-8 at byte {e.start}", "re-encode it as UTF-8"
        ) from e
    except json.JSONDecodeError as e:
        raise _issue(
            plain, "info", str(path), f"is not valid JSON ({json_error(e)})", "repair the file"
        ) from e
    if not isinstance(table, dict) or plain.name not in table or not isinstance(table[plain.name], dict):
        names = sorted(table) if isinstance(table, dict) else []
        raise _issue(plain, "name", plain.name, f"is not an entry of {path}", f"use one of {names[:20]}")
    spec = table[plain.name]
    hub = [k for k in HUB if spec.get(k)]
    if hub and not spec.get("file_name"):
        raise _issue(
            plain,
            "info",
            str(path),
            f"entry {plain.name!r} is on a hub ({hub[0]}), with no local file_name",
            "download the data once and set file_name (or the dhp entry's path) to the local file",
        )
    return path, spec
