"""JSON and JSONL datasets: a list (or one line each) of conversation records plus a media root.

A record is any layout :mod:`dhp.data.records` reads: LLaVA (``image``/``video`` + ``conversations``
of ``from``/``value``), ShareGPT, LLaMA-Factory (``messages``/``conversations`` + ``images``/
``videos``/``audios``; v1 typed parts) or ms-swift (``messages`` + ``images``/``videos``/``audios``).
Media paths (images, videos and audio alike) are resolved by :func:`path_images` (the dataset's media
root; absolute paths as given). Paths may start
with ``pkg://<package>/`` to point inside an installed package, e.g.
``pkg://dhp.data_assets/demo/captions.json`` for the shipped demo set.

Only an index is held in memory: JSONL lines are byte offsets, read and decoded when a record is
read, so a malformed line (bad JSON, not an object, not UTF-8) is one bad sample, not a failed
dataset; blank lines are no records. Images and audio are opened by the processor.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import replace
from importlib import resources
from pathlib import Path

from dhp.config.schema import DatasetEntry
from dhp.data import bad
from dhp.data.images import ImageRef, image_path
from dhp.data.records import (  # Record and friends re-exported: the formats' readers use them
    IgnoredKeys,
    ImagesFn,
    Layout,
    Record,
    entry_layout,
    normalize,
)
from dhp.errors import DataError


def resolve_path(path: str, *, key: str) -> Path:
    """Resolve a config path: ``pkg://<package>/<sub/path>`` inside an installed package, else as given."""
    if not path.startswith("pkg://"):
        return Path(path).expanduser()
    package, _, sub = path[len("pkg://") :].partition("/")
    try:
        root = resources.files(package)
    except ModuleNotFoundError as e:
        raise DataError(
            f"{key} = {path!r}: package {package!r} is not installed. Fix: install it or use a file path"
        ) from e
    return Path(str(root.joinpath(sub))) if sub else Path(str(root))


def entry_image_root(entry: DatasetEntry, path: Path) -> Path:
    """The entry's media root (``image_root``, or LLaMA-Factory's name ``media_dir``); "" means the
    folder of the dataset file (or the folder itself)."""
    if entry.image_root or entry.media_dir:
        return resolve_path(
            entry.image_root or entry.media_dir, key=f"data.datasets[{entry.name}].image_root"
        )
    return path if path.is_dir() else path.parent


def path_images(root: Path, *, allow_outside: bool, restrict_to: tuple[Path, ...] = ()) -> ImagesFn:
    """The media-field reader of path-based records (images, videos, audios): a path or a non-empty
    list of paths under ``root``."""

    def read(value: object, loc: str) -> tuple[ImageRef, ...]:
        if value is None:
            return ()
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            raise bad.BadSampleError(
                location=loc,
                reason=bad.MALFORMED_RECORD,
                detail=f"media = {value!r}"[:120],
                fix="give a path or a non-empty list of paths",
            )
        return tuple(
            image_path(n, root=root, loc=loc, allow_outside=allow_outside, restrict_to=restrict_to)
            for n in names
        )

    return read


class LlavaDataset:
    """The records of one JSON/JSONL :class:`DatasetEntry` (LLaVA or messages records), validated
    one at a time by :meth:`record`. Holds the parsed list (JSON) or line offsets (JSONL).
    ``use_audio_in_video``: the dataset's default for records without the key."""

    def __init__(
        self,
        entry: DatasetEntry,
        *,
        allow_outside_root: bool = False,
        restrict_to: tuple[Path, ...] = (),
        use_audio_in_video: bool = False,
    ) -> None:
        self.name = entry.name
        self.path = resolve_path(entry.path, key=f"data.datasets[{entry.name}].path")
        if not self.path.is_file():
            raise DataError(
                f"dataset {entry.name!r}: file {self.path} does not exist. "
                "Fix: set data.datasets[].path to an existing .json or .jsonl file"
            )
        self.image_root = entry_image_root(entry, self.path)
        if not self.image_root.is_dir():
            raise DataError(
                f"dataset {entry.name!r}: image_root {self.image_root} is not a directory. "
                "Fix: set data.datasets[].image_root to the folder the image paths are relative to"
            )
        self._images = path_images(self.image_root, allow_outside=allow_outside_root, restrict_to=restrict_to)
        self._raw: list[object] = []
        self._offsets, self._ends, self._lines = array("q"), array("q"), array("q")
        self._read()
        self.layout = replace(entry_layout(entry), use_audio_in_video=use_audio_in_video)
        self.ignored = IgnoredKeys(entry.name)

    def _read(self) -> None:
        """JSON: the parsed list (a parse error fails the dataset). JSONL: the byte offset of each line."""
        if self.path.suffix == ".jsonl":
            self._jsonl = True
            data = self.path.read_bytes()
            pos, line = 0, 0
            while pos < len(data):
                nl = data.find(b"\n", pos)
                end = len(data) if nl < 0 else nl + 1
                line += 1
                if data[pos:end].strip():  # blank lines are no records (as HF datasets/pyarrow read JSONL)
                    self._offsets.append(pos)
                    self._ends.append(end)
                    self._lines.append(line)
                pos = end
            return
        if self.path.suffix != ".json":
            raise DataError(f"dataset {self.name!r}: {self.path} is neither .json nor .jsonl. Fix: rename it")
        self._jsonl = False
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(
                f"dataset {self.name!r}: {self.path} is not UTF-8 at byte {e.start}. Fix: re-encode the "
                "file as UTF-8, or use JSONL so one bad line is one bad sample"
            ) from e
        except json.JSONDecodeError as e:
            raise DataError(
                f"dataset {self.name!r}: {self.path} is not valid JSON ({bad.json_error(e)}). "
                "Fix: repair the file (a JSON list of records), or use JSONL so one bad line is one bad sample"
            ) from e
        if not isinstance(data, list):
            raise DataError(f"dataset {self.name!r}: {self.path} must hold a JSON list of records")
        self._raw = data

    def __len__(self) -> int:
        return len(self._offsets) if self._jsonl else len(self._raw)

    def location(self, index: int) -> str:
        """``"<file>:<line>"`` (1-based line of the file, blank lines counted) for JSONL, ``"<file>[<index>]"`` (0-based record) for JSON."""
        return f"{self.path}:{self._lines[index]}" if self._jsonl else f"{self.path}[{index}]"

    def _raw_record(self, index: int) -> object:
        if not self._jsonl:
            return self._raw[index]
        a, b = self._offsets[index], self._ends[index]
        with open(self.path, "rb") as f:
            f.seek(a)
            line = f.read(b - a)
        return _parse_line(line, loc=self.location(index))

    def record(self, index: int) -> Record:
        """Parse and validate record ``index``; raises :class:`~dhp.data.bad.BadSampleError`."""
        loc = self.location(index)
        raw = self._raw_record(index)
        rec = validate_record(raw, location=loc, images=self._images, layout=self.layout)
        self.ignored.note(rec.ignored)
        return rec


def _parse_line(line: object, *, loc: str) -> object:
    """One JSONL line (bytes or str) -> its JSON value; each failure is one bad sample."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise bad.BadSampleError(
                location=loc,
                reason=bad.INVALID_UTF8,
                detail=f"byte {e.start} of the line is not UTF-8 ({line[e.start : e.start + 4]!r})",
                fix="re-encode the line as UTF-8",
            ) from e
    if not isinstance(line, str) or not line.strip():
        raise bad.BadSampleError(
            location=loc, reason=bad.MALFORMED_RECORD, detail="empty line", fix="remove the empty line"
        )
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise bad.BadSampleError(
            location=loc,
            reason=bad.MALFORMED_RECORD,
            detail=f"invalid JSON ({bad.json_error(e)})",
            fix="repair the line",
        ) from e


def validate_record(
    raw: object,
    *,
    location: str,
    image_root: Path | None = None,
    images: ImagesFn | None = None,
    allow_outside_root: bool = False,
    layout: Layout | None = None,
) -> Record:
    """Check one raw record (any layout of :mod:`dhp.data.records`) and return its :class:`Record`.

    Media fields are read by ``images`` (default: paths under ``image_root``)."""
    if images is None:
        if image_root is None:
            raise ValueError("validate_record needs image_root or images")
        images = path_images(image_root, allow_outside=allow_outside_root)
    return normalize(raw, location=location, layout=layout or Layout(), media=images)
