"""Bad samples: a typed error per sample, and the log that counts them under ``on_bad_sample=skip``.

Every check in ``dhp/data`` raises :class:`BadSampleError` (a ``DataError``) naming the file, the
line or record index, the reason and a fix. Under ``raise`` (the default) it propagates; under
``skip`` the loader records it in a :class:`BadSampleLog` and moves on. Nothing is truncated.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from dhp.errors import DataError

log = logging.getLogger("dhp.data")
SHOW_SKIPPED = 5  # skipped samples named on the console; every one goes to the run dir's file

ON_BAD_SAMPLE = ("raise", "skip")

# Stable reason names (metrics keys ``data/bad/<reason>`` and the check summary).
MISSING_FILE = "missing_file"
CORRUPT_IMAGE = "corrupt_image"
PLACEHOLDER_MISMATCH = "placeholder_mismatch"
VISION_TOO_LONG = "vision_too_long"
TEXT_TOO_LONG = "text_too_long"
BAD_CONVERSATION = "bad_conversation"
MALFORMED_RECORD = "malformed_record"
PATH_OUTSIDE_ROOT = "path_outside_root"  # ../ or an absolute path outside the image root
NOT_A_FILE = "not_a_file"  # the image path is a directory (or a socket, fifo, ...)
SYMLINK_LOOP = "symlink_loop"
DECOMPRESSION_BOMB = "decompression_bomb"  # more pixels than PIL's MAX_IMAGE_PIXELS
INVALID_UTF8 = "invalid_utf8"  # a JSONL line (or a shard's JSON) that is not UTF-8
CORRUPT_VIDEO = "corrupt_video"  # a video file that cannot be decoded (or frames of mixed sizes)
EMPTY_VIDEO = "empty_video"  # a video with zero frames (an empty frames folder)
UNSUPPORTED_MODALITY = "unsupported_modality"  # audio (no audio module); video (a family without video)
CORRUPT_AUDIO = "corrupt_audio"  # an audio file (or a video's audio track) that cannot be decoded
EMPTY_AUDIO = "empty_audio"  # an audio with zero samples
AUDIO_TOO_LONG = "audio_too_long"  # longer than the configured seconds (read from the header first)
NO_AUDIO_TRACK = "no_audio_track"  # use_audio_in_video on a video file without an audio stream
REASONS = (
    MISSING_FILE,
    CORRUPT_IMAGE,
    PLACEHOLDER_MISMATCH,
    VISION_TOO_LONG,
    TEXT_TOO_LONG,
    BAD_CONVERSATION,
    MALFORMED_RECORD,
    PATH_OUTSIDE_ROOT,
    NOT_A_FILE,
    SYMLINK_LOOP,
    DECOMPRESSION_BOMB,
    INVALID_UTF8,
    CORRUPT_VIDEO,
    EMPTY_VIDEO,
    UNSUPPORTED_MODALITY,
    CORRUPT_AUDIO,
    EMPTY_AUDIO,
    AUDIO_TOO_LONG,
    NO_AUDIO_TRACK,
)


def json_error(e: json.JSONDecodeError) -> str:
    """The whole of a JSON parse error: what, where, and the text around it (``e.msg`` alone is cut,
    e.g. "Invalid control character at")."""
    start = max(0, e.pos - 20)
    near = e.doc[start : e.pos + 20].replace("\n", "\\n").replace("\t", "\\t")
    near = "".join(c if c.isprintable() else repr(c)[1:-1] for c in near)
    return f"{e.msg}: line {e.lineno} column {e.colno} (char {e.pos}), near {near!r}"


class BadSampleError(DataError):
    """One bad sample: ``location`` is ``"<file>:<line>"``, ``"<file>[<record>]"`` or ``"<shard>:<key>"``, ``reason`` one of :data:`REASONS`."""

    def __init__(self, *, location: str, reason: str, detail: str, fix: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown bad-sample reason {reason!r}")
        self.location = location
        self.reason = reason
        self.detail = detail
        self.fix = fix
        super().__init__(
            f"bad sample at {location} ({reason}): {detail}. Fix: {fix}; "
            "or set data.on_bad_sample=skip to skip and count such samples"
        )


@dataclass
class BadSampleLog:
    """Counts of skipped samples by reason, with the first ``keep`` locations and details of each."""

    keep: int = 5
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    # every sample added since the last take_recent(): {location, reason, detail} (not in the state)
    recent: list[dict[str, str]] = field(default_factory=list)

    def add(self, err: BadSampleError) -> None:
        """Count ``err`` under its reason and remember its location while fewer than ``keep`` are kept."""
        self.counts[err.reason] = self.counts.get(err.reason, 0) + 1
        self.recent.append({"location": err.location, "reason": err.reason, "detail": err.detail})
        kept = self.examples.setdefault(err.reason, [])
        if len(kept) < self.keep:
            kept.append(f"{err.location}: {err.detail}")

    @property
    def total(self) -> int:
        """Number of bad samples seen."""
        return sum(self.counts.values())

    def metrics(self) -> dict[str, int]:
        """Flat metrics: ``data/bad/<reason>`` for every reason seen, and ``data/bad/total``."""
        out = {f"data/bad/{r}": n for r, n in sorted(self.counts.items())}
        out["data/bad/total"] = self.total
        return out

    def state_dict(self) -> dict:
        """JSON-able state (goes into the checkpoint's ``data_state``)."""
        return {"counts": dict(self.counts), "examples": {k: list(v) for k, v in self.examples.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore counts and examples saved by :meth:`state_dict`."""
        self.counts = {str(k): int(v) for k, v in state["counts"].items()}
        self.examples = {str(k): list(v) for k, v in state["examples"].items()}
        self.recent = []

    def take_recent(self) -> list[dict[str, str]]:
        """The samples added since the last call (the records one step skipped), and forget them."""
        out, self.recent = self.recent, []
        return out

    def summary(self) -> str:
        """One line per reason, e.g. for the end-of-run summary."""
        if not self.counts:
            return "bad samples: none"
        lines = [f"bad samples skipped: {self.total}"]
        for reason, n in sorted(self.counts.items()):
            first = "; ".join(self.examples[reason][:2])
            lines.append(f"  {reason}: {n} (first: {first})")
        return "\n".join(lines)


class SkippedRecords:
    """Names every skipped sample: one JSON line ``{step, location, reason, detail}`` per sample in
    ``path`` (the run dir's ``bad_samples.jsonl``; ``step`` is 1-based, the step whose batch skipped
    it, as in ``metrics.jsonl``), and the first :data:`SHOW_SKIPPED` on the console
    (the ``dhp.data`` logger). Steps already in the file (a resumed run serves them again) are not
    written twice."""

    FILE = "bad_samples.jsonl"

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.shown = 0
        self.written_upto = -1  # the last step whose skipped samples the file holds
        if path is not None and path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    self.written_upto = max(self.written_upto, int(json.loads(line)["step"]))
                    self.shown += 1

    def record(self, step: int, skipped: list[dict[str, str]]) -> None:
        """Write and show the samples that step ``step`` skipped."""
        if not skipped or step <= self.written_upto:
            return
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                for s in skipped:
                    f.write(json.dumps({"step": step, **s}) + "\n")
            self.written_upto = step
        for s in skipped:
            if self.shown < SHOW_SKIPPED:
                log.warning("skipped bad sample at %s (%s): %s", s["location"], s["reason"], s["detail"])
            elif self.shown == SHOW_SKIPPED:
                where = f"; every one is in {self.path}" if self.path is not None else ""
                log.warning("more bad samples skipped (counted in metrics.jsonl's bad_samples%s)", where)
            self.shown += 1
