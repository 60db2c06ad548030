"""WebDataset tar shards: the members ``<key>.json`` + ``<key>.jpg`` (or ``.png``, ``.0.jpg``, ...) are one sample.

``path`` is a ``.tar`` file, a folder of them (sorted), a glob, or a brace range
(``shards/train-{0000..0127}.tar``). The key of a member is its name up to the first dot of its
last path component (the WebDataset convention). ``<key>.json`` holds a LLaVA or messages record;
its ``image``/``images`` field, when present, names the key's members by extension (``"jpg"``,
``["0.png", "1.png"]``), else the record's images are all image members of the key in extension
order. A record's location is ``<shard>:<key>``.

Memory: the index holds, per sample, the shard number, the key and each member's offset and size
(read once from the tar headers, no data); members are read with one seek each. Shards must be
uncompressed tars (seekable), as WebDataset writes them.
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

from dhp.config.schema import DatasetEntry
from dhp.data import bad
from dhp.data.images import ImageBlob, ImageRef
from dhp.data.llava import Record, resolve_path, validate_record
from dhp.data.records import IgnoredKeys, entry_layout
from dhp.data.tabular import list_files
from dhp.errors import DataError

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def expand_shards(spec: str) -> list[Path]:
    """``a-{000..003}.tar`` -> the four paths (zero padding kept); other paths via :func:`list_files`."""
    m = _BRACE.search(spec)
    if m is None:
        return list_files(Path(spec), (".tar",))
    lo, hi = m.group(1), m.group(2)
    width = len(lo)
    out = []
    for i in range(int(lo), int(hi) + 1):
        name = spec[: m.start()] + str(i).zfill(width) + spec[m.end() :]
        # a named shard is listed even when missing, so the caller can say which one is
        out += expand_shards(name) if _BRACE.search(name) or any(c in name for c in "*?[") else [Path(name)]
    return out


def split_key(name: str) -> tuple[str, str]:
    """``dir/abc.0.jpg`` -> (``dir/abc``, ``0.jpg``)."""
    head, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext


class WebDataset:
    """The samples of one WebDataset :class:`DatasetEntry` (tar shards)."""

    def __init__(self, entry: DatasetEntry, **_media_rules: object) -> None:
        """``_media_rules`` (the path rules of file-based datasets) do not apply: media are members."""
        self.name = entry.name
        spec = entry.path if entry.path.startswith("pkg://") else str(Path(entry.path).expanduser())
        if spec.startswith("pkg://"):
            spec = str(resolve_path(spec, key=f"data.datasets[{entry.name}].path"))
        self.shards = expand_shards(spec)
        if not self.shards:
            raise DataError(
                f"dataset {entry.name!r}: no .tar shard at {spec}. Fix: point data.datasets[].path "
                "at a shard, a folder of shards, a glob or a brace range like train-{0000..0127}.tar"
            )
        missing = [s for s in self.shards if not s.is_file()]
        if missing:
            raise DataError(
                f"dataset {entry.name!r}: shard {missing[0]} does not exist ({len(missing)} missing). "
                "Fix: check data.datasets[].path and that the shared storage is mounted"
            )
        # per sample: (shard, key, {ext: (offset, size)})
        self._index: list[tuple[int, str, dict[str, tuple[int, int]]]] = []
        for s, shard in enumerate(self.shards):
            self._index += [(s, key, members) for key, members in _scan(shard, dataset=entry.name)]
        self.layout = entry_layout(entry)
        self.ignored = IgnoredKeys(entry.name)

    def __len__(self) -> int:
        return len(self._index)

    def location(self, index: int) -> str:
        s, key, _ = self._index[index]
        return f"{self.shards[s]}:{key}"

    def _read(self, s: int, offset: int, size: int) -> bytes:
        with open(self.shards[s], "rb") as f:
            f.seek(offset)
            return f.read(size)

    def record(self, index: int) -> Record:
        """Read and validate sample ``index``; raises :class:`~dhp.data.bad.BadSampleError`."""
        s, key, members = self._index[index]
        loc = self.location(index)
        if "json" not in members and "txt" not in members:
            raise bad.BadSampleError(
                location=loc,
                reason=bad.MALFORMED_RECORD,
                detail=f"no {key}.json or {key}.txt member (members: {sorted(members)})",
                fix="write the conversation of each sample as <key>.json (or its caption as <key>.txt)",
            )
        raw = self._json(s, key, members, loc) if "json" in members else {}
        raw = self._caption_record(raw, s=s, key=key, members=members, loc=loc)
        if isinstance(raw, list):  # a member that is a bare list of turns
            raw = {self.layout.messages[0]: raw}
        if isinstance(raw, dict) and all(raw.get(k) is None for k in self.layout.images):
            found = sorted(e for e in members if "." + e.rsplit(".", 1)[-1].lower() in IMAGE_EXTS)
            if found:  # no image field: the key's image members, in extension order
                raw = {**raw, self.layout.images[0]: found}
        rec = validate_record(
            raw, location=loc, images=self._member_images(s, key, members), layout=self.layout
        )
        self.ignored.note(rec.ignored)
        return rec

    def _caption_record(self, raw: object, *, s: int, key: str, members: dict, loc: str) -> object:
        """A caption shard's sample (img2dataset writes ``<key>.jpg``, ``<key>.txt`` and a metadata
        ``<key>.json`` with ``caption``): no turns -> a pre-training record, one assistant turn holding
        the caption (its image goes first). Anything else is returned as it is."""
        if not isinstance(raw, dict) or any(k in raw for k in self.layout.turn_keys):
            return raw
        if "txt" in members:
            try:
                caption = self._read(s, *members["txt"]).decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise bad.BadSampleError(
                    location=loc,
                    reason=bad.INVALID_UTF8,
                    detail=f"{key}.txt byte {e.start} is not UTF-8",
                    fix="re-encode the member as UTF-8",
                ) from e
        elif isinstance(raw.get("caption"), str):
            caption = raw["caption"]
        else:
            return raw
        rest = {k: v for k, v in raw.items() if k != "caption"}
        return {**rest, self.layout.messages[0]: [{"role": "assistant", "content": caption}]}

    def _json(self, s: int, key: str, members: dict, loc: str) -> object:
        """The parsed ``<key>.json`` member (invalid UTF-8 or JSON: one bad sample)."""
        data = self._read(s, *members["json"])
        try:
            raw = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise bad.BadSampleError(
                location=loc,
                reason=bad.INVALID_UTF8,
                detail=f"{key}.json byte {e.start} is not UTF-8",
                fix="re-encode the member as UTF-8",
            ) from e
        except json.JSONDecodeError as e:
            raise bad.BadSampleError(
                location=loc,
                reason=bad.MALFORMED_RECORD,
                detail=f"{key}.json is not valid JSON ({bad.json_error(e)})",
                fix="repair the member",
            ) from e
        return raw

    def _member_images(self, s: int, key: str, members: dict[str, tuple[int, int]]):
        """The media reader of one sample: a record's ``image``/``images`` value names members by
        extension (``"jpg"``, ``["0.png", "1.png"]``) or by file name (``"000123.jpg"``, as converters
        that store a whole LLaVA record write it)."""
        stem = key.rpartition("/")[2]

        def images(value: object, where: str) -> tuple[ImageRef, ...]:
            exts = [value] if isinstance(value, str) else value
            out = []
            for ext in exts:
                if isinstance(ext, str) and ext not in members and ext.startswith(stem + "."):
                    ext = ext[len(stem) + 1 :]
                if not isinstance(ext, str) or ext not in members:
                    raise bad.BadSampleError(
                        location=where,
                        reason=bad.MISSING_FILE,
                        detail=f"no member {key}.{ext} in the shard",
                        fix='name the key\'s image members by extension ("jpg") or file name ("<key>.jpg")',
                    )
                out.append(ImageBlob(name=f"{key}.{ext}", data=self._read(s, *members[ext])))
            return tuple(out)

        return images


def _scan(shard: Path, *, dataset: str) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """``(key, {ext: (data offset, size)})`` per sample of ``shard``, in tar order (headers only)."""
    samples: dict[str, dict[str, tuple[int, int]]] = {}
    try:
        with tarfile.open(shard, mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = split_key(member.name)
                samples.setdefault(key, {})[ext] = (member.offset_data, member.size)
    except tarfile.TarError as e:
        raise DataError(
            f"dataset {dataset!r}: {shard} is not an uncompressed tar ({e}). Fix: write shards as "
            "plain .tar (WebDataset's ShardWriter does), not .tar.gz"
        ) from e
    return list(samples.items())
