"""Parquet and Arrow datasets (HF ``datasets`` exports): one record per row, images as bytes or paths.

``path`` is a ``.parquet``/``.arrow`` file, a folder holding them (searched recursively, sorted), or
a glob. The text column is ``text_column`` (default: ``messages`` if present, else
``conversations``) and is read as a record's turns (:mod:`dhp.data.records`); the image column is
``image_column`` (default: ``images``, else ``image``, else none). An image cell is an HF
``Image`` struct ``{"bytes", "path"}`` (bytes win; a path alone is read under the image root), a
path string, raw bytes, or a list of those. The audio column is the first of the layout's audio
names present (``audios``, else ``audio``; or ``columns.audios``): a path string, an HF ``Audio``
struct ``{"bytes", "path"}`` holding only a path, or a list of those, read under the image root as
image paths are; audio bytes inside the table are refused by name (audio must be files). A record's
location is ``<file>[<row>]`` (0-based row of that file).

Memory: only the file list and row counts at open; a parquet row group is read when one of its
rows is asked for, and the last two are kept per process. Arrow files are memory-mapped.
"""

from __future__ import annotations

import bisect
import glob
import threading
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

from dhp.config.schema import DatasetEntry
from dhp.data import bad
from dhp.data.images import ImageBlob, ImageRef, image_path
from dhp.data.llava import Record, entry_image_root, resolve_path, validate_record
from dhp.data.records import IgnoredKeys, entry_layout
from dhp.errors import DataError

SUFFIXES = (".parquet", ".arrow")
_CACHE_GROUPS = 2


def list_files(path: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """The data files of ``path``: itself, the matching files below a folder, or a glob's matches."""
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.suffix in suffixes and p.is_file())
    return sorted(Path(p) for p in glob.glob(str(path)) if Path(p).suffix in suffixes)


class TabularDataset:
    """The rows of one parquet/arrow :class:`DatasetEntry` as records."""

    def __init__(
        self,
        entry: DatasetEntry,
        *,
        allow_outside_root: bool = False,
        restrict_to: tuple[Path, ...] = (),
        use_audio_in_video: bool = False,
    ) -> None:
        import pyarrow.parquet as pq

        self.name = entry.name
        root = resolve_path(entry.path, key=f"data.datasets[{entry.name}].path")
        self.files = list_files(root, SUFFIXES)
        if not self.files:
            raise DataError(
                f"dataset {entry.name!r}: no .parquet or .arrow file at {root}. Fix: point "
                "data.datasets[].path at a parquet/arrow file, a folder of them, or a glob"
            )
        self.image_root = entry_image_root(entry, root if root.is_dir() else self.files[0])
        self.allow_outside = allow_outside_root
        self.restrict_to = restrict_to
        counts, groups, self._schema = [], [], None
        for f in self.files:
            try:
                if f.suffix == ".parquet":
                    meta = pq.ParquetFile(f).metadata
                    sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
                    schema = pq.read_schema(f)
                else:
                    table = _arrow_table(f)
                    sizes, schema = [table.num_rows], table.schema
            except Exception as e:  # pyarrow raises several types for a broken file
                raise DataError(
                    f"dataset {entry.name!r}: {f} cannot be read as {f.suffix[1:]} ({e}). Fix: re-export it"
                ) from e
            counts.append(sum(sizes))
            groups.append(sizes)
            self._schema = self._schema or schema
        names = set(self._schema.names)
        self.text_column = entry.text_column or ("messages" if "messages" in names else "conversations")
        self.image_column = entry.image_column or next((c for c in ("images", "image") if c in names), "")
        for col in (self.text_column, self.image_column):
            if col and col not in names:
                raise DataError(
                    f"dataset {entry.name!r}: {self.files[0]} has no column {col!r} (columns: "
                    f"{sorted(names)}). Fix: set data.datasets[].text_column / image_column"
                )
        self.layout = replace(entry_layout(entry), use_audio_in_video=use_audio_in_video)
        self.audio_column = next((c for c in self.layout.audios if c in names), "")
        self.ignored = IgnoredKeys(entry.name)
        self._columns = [
            c for c in (self.text_column, self.image_column, self.audio_column) if c and c in names
        ]
        self._offsets = [0]
        for n in counts:
            self._offsets.append(self._offsets[-1] + n)
        self._group_starts = [[0, *_cumsum(g)] for g in groups]
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_cache"], state["_lock"] = OrderedDict(), None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._offsets[-1]

    def _split(self, index: int) -> tuple[int, int]:
        f = bisect.bisect_right(self._offsets, index) - 1
        return f, index - self._offsets[f]

    def location(self, index: int) -> str:
        f, row = self._split(index)
        return f"{self.files[f]}[{row}]"

    def _row(self, f: int, row: int) -> dict:
        """The selected columns of one row as Python values (reads and caches its row group)."""
        starts = self._group_starts[f]
        g = bisect.bisect_right(starts, row) - 1
        with self._lock:
            table = self._cache.get((f, g))
            if table is not None:
                self._cache.move_to_end((f, g))
        if table is None:
            path = self.files[f]
            if path.suffix == ".parquet":
                import pyarrow.parquet as pq

                table = pq.ParquetFile(path).read_row_group(g, columns=self._columns)
            else:
                table = _arrow_table(path).select(self._columns)
            with self._lock:
                self._cache[(f, g)] = table
                while len(self._cache) > _CACHE_GROUPS:
                    self._cache.popitem(last=False)
        return table.slice(row - starts[g], 1).to_pylist()[0]

    def record(self, index: int) -> Record:
        """Read and validate row ``index``; raises :class:`~dhp.data.bad.BadSampleError`."""
        loc = self.location(index)
        row = self._row(*self._split(index))
        raw = {self.layout.messages[0]: row[self.text_column]}
        if self.image_column and row[self.image_column] is not None:
            raw[self.layout.images[0]] = row[self.image_column]
        if self.audio_column and row[self.audio_column] is not None:
            raw[self.layout.audios[0]] = self._audio_paths(row[self.audio_column], loc=loc)
        return validate_record(raw, location=loc, images=self._images, layout=self.layout)

    def _images(self, value: object, loc: str) -> tuple[ImageRef, ...]:
        if value is None:
            return ()
        cells = value if isinstance(value, list) else [value]
        return tuple(self._image(c, loc=loc, k=k) for k, c in enumerate(cells))

    def _audio_paths(self, value: object, *, loc: str) -> list[object]:
        """An audio cell (or list of cells) as the path strings the record reader resolves; an HF
        ``Audio`` struct gives its ``path``, and one holding bytes is refused (audio must be files)."""
        cells = value if isinstance(value, list) else [value]
        out = []
        for k, cell in enumerate(cells):
            if isinstance(cell, dict):
                if cell.get("bytes"):
                    raise bad.BadSampleError(
                        location=loc,
                        reason=bad.CORRUPT_AUDIO,
                        detail=f"audio {k} of column {self.audio_column!r} is stored inside the table",
                        fix="keep audio as files next to the dataset and give their paths in the column",
                    )
                cell = cell.get("path")
            if not (isinstance(cell, str) and cell):
                raise bad.BadSampleError(
                    location=loc,
                    reason=bad.MALFORMED_RECORD,
                    detail=f"audio {k} of column {self.audio_column!r} is {str(cell)[:60]!r}",
                    fix="give each audio as a path, or an Audio struct {path} (bytes: null)",
                )
            out.append(cell)
        return out

    def _image(self, cell: object, *, loc: str, k: int) -> ImageRef:
        if isinstance(cell, dict):
            data, path = cell.get("bytes"), cell.get("path")
            if data:
                return ImageBlob(name=path or f"image {k}", data=bytes(data))
            cell = path
        if isinstance(cell, (bytes, bytearray)) and cell:
            return ImageBlob(name=f"image {k}", data=bytes(cell))
        if isinstance(cell, str) and cell:
            return image_path(
                cell,
                root=self.image_root,
                loc=loc,
                allow_outside=self.allow_outside,
                restrict_to=self.restrict_to,
            )
        raise bad.BadSampleError(
            location=loc,
            reason=bad.MALFORMED_RECORD,
            detail=f"image {k} of column {self.image_column!r} is {str(cell)[:60]!r}",
            fix="give each image as {bytes, path}, a path, or bytes",
        )


def _cumsum(values: list[int]) -> list[int]:
    out, acc = [], 0
    for v in values:
        acc += v
        out.append(acc)
    return out


def _arrow_table(path: Path):
    """An Arrow IPC file or stream (``datasets.save_to_disk`` writes streams), memory-mapped."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()
