"""What every record format validates into: one :class:`Record` per conversation.

``dhp.data.llava`` and ``dhp.data.messages`` (and the wds/parquet readers through them) validate their
own record shapes into this one type, with ``<image>`` (:data:`IMAGE_PLACEHOLDER`) in the turn text
where each image goes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dhp.data.images import ImageRef

# value of a record's image field -> image references (None -> no image)
ImagesFn = Callable[[object, str], tuple[ImageRef, ...]]

IMAGE_PLACEHOLDER = "<image>"


@dataclass(frozen=True)
class Record:
    """One validated conversation: ``turns`` are ``(role, text)`` with chat-template role names."""

    location: str
    images: tuple[ImageRef, ...]
    turns: tuple[tuple[str, str], ...]
    videos: tuple[Path, ...] = ()  # a folder of frames or a video file per <video> placeholder
