"""LLaVA-format datasets: a JSON list or JSONL file of conversations plus an image root.

A record is ``{"id"?: str, "image"?: str | [str, ...], "conversations": [{"from": "human"|"gpt"|
"system", "value": str}, ...]}``. Each ``<image>`` placeholder in a human turn stands for the next
image of ``image``, in order. Image paths are relative to the dataset's ``image_root`` (or
absolute). Paths may start with ``pkg://<package>/`` to point inside an installed package, e.g.
``pkg://dhp.data_assets/demo/captions.json`` for the shipped demo set.

Only the record index is held in memory: JSONL lines stay raw strings until a record is read, so a
malformed line is one bad sample, not a failed dataset. Images are opened by the processor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dhp.config.schema import DatasetEntry
from dhp.data import bad
from dhp.errors import DataError

IMAGE_PLACEHOLDER = "<image>"
ALLOWED_KEYS = ("id", "image", "conversations")
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


@dataclass(frozen=True)
class Record:
    """One validated conversation: ``turns`` are ``(role, text)`` with chat-template role names."""

    location: str
    images: tuple[Path, ...]
    turns: tuple[tuple[str, str], ...]


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


class LlavaDataset:
    """The records of one :class:`DatasetEntry`, validated one at a time by :meth:`record`."""

    def __init__(self, entry: DatasetEntry) -> None:
        self.name = entry.name
        self.path = resolve_path(entry.path, key=f"data.datasets[{entry.name}].path")
        self.image_root = resolve_path(entry.image_root, key=f"data.datasets[{entry.name}].image_root")
        if not self.path.is_file():
            raise DataError(
                f"dataset {entry.name!r}: file {self.path} does not exist. "
                "Fix: set data.datasets[].path to an existing .json or .jsonl file"
            )
        if not self.image_root.is_dir():
            raise DataError(
                f"dataset {entry.name!r}: image_root {self.image_root} is not a directory. "
                "Fix: set data.datasets[].image_root to the folder the image paths are relative to"
            )
        self._raw: list[object] = self._read()

    def _read(self) -> list[object]:
        """JSON: the parsed list (a parse error fails the dataset). JSONL: one raw string per line."""
        text = self.path.read_text(encoding="utf-8")
        if self.path.suffix == ".jsonl":
            self._jsonl = True
            return list(text.splitlines())
        if self.path.suffix != ".json":
            raise DataError(f"dataset {self.name!r}: {self.path} is neither .json nor .jsonl. Fix: rename it")
        self._jsonl = False
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(
                f"dataset {self.name!r}: {self.path} line {e.lineno} col {e.colno} is not valid JSON ({e.msg}). "
                "Fix: repair the file (a JSON list of records), or use JSONL so one bad line is one bad sample"
            ) from e
        if not isinstance(data, list):
            raise DataError(f"dataset {self.name!r}: {self.path} must hold a JSON list of records")
        return data

    def __len__(self) -> int:
        return len(self._raw)

    def location(self, index: int) -> str:
        """``"<file>:<line>"`` (1-based line) for JSONL, ``"<file>[<index>]"`` (0-based record) for JSON."""
        return f"{self.path}:{index + 1}" if self._jsonl else f"{self.path}[{index}]"

    def record(self, index: int) -> Record:
        """Parse and validate record ``index``; raises :class:`~dhp.data.bad.BadSampleError`."""
        loc = self.location(index)
        raw = self._raw[index]
        if self._jsonl:
            raw = _parse_line(raw, loc=loc)
        return validate_record(raw, location=loc, image_root=self.image_root)


def _parse_line(line: object, *, loc: str) -> object:
    if not isinstance(line, str) or not line.strip():
        raise bad.BadSampleError(
            location=loc, reason=bad.MALFORMED_RECORD, detail="empty line", fix="remove the empty line"
        )
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise bad.BadSampleError(
            location=loc, reason=bad.MALFORMED_RECORD, detail=f"invalid JSON ({e.msg})", fix="repair the line"
        ) from e


def _bad(loc: str, reason: str, detail: str, fix: str) -> bad.BadSampleError:
    return bad.BadSampleError(location=loc, reason=reason, detail=detail, fix=fix)


def validate_record(raw: object, *, location: str, image_root: Path) -> Record:
    """Check keys, turn structure and placeholders of one raw record and return a :class:`Record`."""
    loc = location
    if not isinstance(raw, dict):
        raise _bad(
            loc, bad.MALFORMED_RECORD, f"record is {type(raw).__name__}, not an object", "use a JSON object"
        )
    unknown = sorted(set(raw) - set(ALLOWED_KEYS))
    if unknown:
        raise _bad(loc, bad.UNKNOWN_KEYS, f"unknown keys {unknown}", f"use only {list(ALLOWED_KEYS)}")
    images = _images(raw.get("image"), loc=loc, image_root=image_root)
    turns = _turns(raw.get("conversations"), loc=loc)
    placeholders = 0
    for i, (role, text) in enumerate(turns):
        n = text.count(IMAGE_PLACEHOLDER)
        if n and role != "user":
            raise _bad(
                loc,
                bad.PLACEHOLDER_MISMATCH,
                f"conversations[{i}] ({role}) contains {IMAGE_PLACEHOLDER}",
                "put image placeholders in human turns only",
            )
        placeholders += n
    if placeholders != len(images):
        raise _bad(
            loc,
            bad.PLACEHOLDER_MISMATCH,
            f"{placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but {len(images)} image(s)",
            f"write one {IMAGE_PLACEHOLDER} per image, in image order",
        )
    return Record(location=loc, images=images, turns=turns)


def _images(value: object, *, loc: str, image_root: Path) -> tuple[Path, ...]:
    if value is None:
        return ()
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise _bad(
            loc, bad.MALFORMED_RECORD, f"image = {value!r}", "give a path or a non-empty list of paths"
        )
    return tuple(image_root / n for n in names)


def _turns(value: object, *, loc: str) -> tuple[tuple[str, str], ...]:
    """Turns must be: optional system first, then human/gpt alternating, ending with gpt."""
    fix = 'give [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]'
    if not isinstance(value, list) or not value:
        raise _bad(loc, bad.BAD_CONVERSATION, "conversations is missing or empty", fix)
    turns: list[tuple[str, str]] = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or set(turn) != {"from", "value"}:
            raise _bad(
                loc, bad.BAD_CONVERSATION, f"conversations[{i}] = {turn!r} is not {{from, value}}", fix
            )
        role, text = turn["from"], turn["value"]
        if role not in ROLES or not isinstance(text, str):
            raise _bad(loc, bad.BAD_CONVERSATION, f"conversations[{i}] has from={role!r}", fix)
        if not text.strip():
            raise _bad(
                loc, bad.BAD_CONVERSATION, f"conversations[{i}] has an empty value", "remove or fill it"
            )
        turns.append((ROLES[role], text))
    body = turns[1:] if turns[0][0] == "system" else turns
    expected = ["user", "assistant"] * ((len(body) + 1) // 2)
    if not body or [r for r, _ in body] != expected[: len(body)] or body[-1][0] != "assistant":
        roles = [r for r, _ in turns]
        raise _bad(
            loc, bad.BAD_CONVERSATION, f"roles {roles} do not alternate human/gpt ending with gpt", fix
        )
    return tuple(turns)
