"""Image references of a record and the guards applied before any image byte is decoded.

A record names its images either by path (LLaVA/messages JSON, parquet ``path`` entries) or by
embedded bytes (parquet ``bytes``, WebDataset members). Paths go through :func:`image_path`
(absolute as given; relative ones may not climb out of the dataset's media root unless
``data.allow_outside_root``; all under ``data.restrict_media_to`` when set); every image goes
through :func:`open_image` (not a directory, no symlink loop, no decompression bomb, decodes in
full). Each failure is one :class:`~dhp.data.bad.BadSampleError` with its own reason.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from dhp.data import bad


@dataclass(frozen=True)
class ImageBlob:
    """An image stored inside the dataset: ``name`` (for messages) and the encoded ``data`` bytes."""

    name: str
    data: bytes


ImageRef = Path | ImageBlob

# PIL reports a decompression bomb with a warning (over MAX_IMAGE_PIXELS) or an error (over twice
# that). Catching the warning needs the process-wide warnings filter, so opening (header only, cheap)
# is serialised; the full decode runs outside the lock.
_OPEN_LOCK = threading.Lock()


def _bad(loc: str, reason: str, detail: str, fix: str) -> bad.BadSampleError:
    return bad.BadSampleError(location=loc, reason=reason, detail=detail, fix=fix)


def image_path(
    name: str, *, root: Path, loc: str, allow_outside: bool, restrict_to: tuple[Path, ...] = ()
) -> Path:
    """The media file ``name`` names: as given when absolute, else ``root / name``.

    A relative path may not climb out of ``root`` with ``..`` (checked lexically: symlinks inside the
    root are the dataset's own) unless ``allow_outside``. With ``restrict_to`` (``data.restrict_media_to``),
    every path, absolute or relative, must lie under one of those roots after symlinks are resolved.
    """
    absolute = os.path.isabs(name)
    full = Path(os.path.normpath(name if absolute else os.path.join(root, name)))
    if not absolute and not allow_outside:
        base = Path(os.path.normpath(os.path.abspath(root)))
        if not Path(os.path.abspath(full)).is_relative_to(base):
            raise _bad(
                loc,
                bad.PATH_OUTSIDE_ROOT,
                f"media {name!r} climbs out of the dataset's media root {base} (to {full})",
                "keep relative paths inside image_root/media_dir, use an absolute path, or set "
                "data.allow_outside_root=true",
            )
    if restrict_to:
        real = Path(os.path.realpath(full))
        if not any(real.is_relative_to(r) for r in restrict_to):
            raise _bad(
                loc,
                bad.PATH_OUTSIDE_ROOT,
                f"media {name!r} resolves to {real}, outside data.restrict_media_to {[str(r) for r in restrict_to]}",
                "move the file under an allowed root, or ask whoever set data.restrict_media_to",
            )
    return full


def check_file(path: Path, *, loc: str, kind: str = "image") -> None:
    """Missing, symlink loop, or not a regular file: each its own reason (``kind`` names the media)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _bad(
                loc, bad.SYMLINK_LOOP, f"{kind} {path} is a symlink loop", "point the link at a real file"
            ) from e
        raise _bad(
            loc, bad.MISSING_FILE, f"{kind} {path} does not exist", "restore the file or fix the path"
        ) from e
    if not stat.S_ISREG(mode):
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise _bad(
            loc, bad.NOT_A_FILE, f"{kind} {path} is {what}", f"point the record at the {kind} file itself"
        )


def open_image(ref: ImageRef, *, loc: str) -> Image.Image:
    """Open and fully decode ``ref`` (a truncated file fails here, not later).

    The mode is left as stored: the image processor converts to RGB (transparency onto white).
    """
    if isinstance(ref, ImageBlob):
        label, source = f"embedded image {ref.name!r}", io.BytesIO(ref.data)
    else:
        check_file(ref, loc=loc)
        label, source = f"image {ref}", ref
    try:
        with _OPEN_LOCK, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(source)
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        raise _bad(
            loc,
            bad.DECOMPRESSION_BOMB,
            f"{label} declares more than {Image.MAX_IMAGE_PIXELS} pixels ({e})",
            "downscale the image; a real photo never needs that many pixels",
        ) from None
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as e:
        raise _bad(loc, bad.CORRUPT_IMAGE, f"{label} cannot be decoded ({e})", "replace the file") from e
    try:
        with im:
            im.load()
            return im.copy()
    except (OSError, SyntaxError, ValueError) as e:
        raise _bad(loc, bad.CORRUPT_IMAGE, f"{label} cannot be decoded ({e})", "replace the file") from e
