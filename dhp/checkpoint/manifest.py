"""``manifest.json``: one checksum per file of a checkpoint, written at commit, verified at resume.

The hash is BLAKE2b (Python's ``hashlib``; fast in software, maintained with CPython, no extra
dependency), 128-bit digests, read in 4 MiB blocks so memory stays flat whatever the shard size.
The manifest covers every file under the checkpoint directory except ``meta.json`` (written after
it) and itself. A checkpoint saved before manifests existed has none and is reported as such.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dhp.checkpoint.meta import META_FILE
from dhp.errors import CheckpointError

MANIFEST_FILE = "manifest.json"
HASH_NAME = "blake2b-128"
_BLOCK = 4 << 20


def file_digest(path: Path) -> str:
    """The hex BLAKE2b-128 digest of one file, streamed."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _files(ckpt_dir: Path) -> list[Path]:
    skip = {META_FILE, MANIFEST_FILE}
    return sorted(
        p for p in Path(ckpt_dir).rglob("*") if p.is_file() and not (p.parent == ckpt_dir and p.name in skip)
    )


def write_manifest(ckpt_dir: Path) -> Path:
    """Hash every file under ``ckpt_dir`` and write ``manifest.json`` durably; returns its path."""
    ckpt_dir = Path(ckpt_dir)
    files = {
        str(p.relative_to(ckpt_dir)): {"size": p.stat().st_size, "digest": file_digest(p)}
        for p in _files(ckpt_dir)
    }
    path = ckpt_dir / MANIFEST_FILE
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump({"hash": HASH_NAME, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def verify_checkpoint(ckpt_dir: Path) -> list[str]:
    """Every problem found in ``ckpt_dir`` (empty list: it verifies). Never raises for bad content.

    Checks: ``meta.json`` present and JSON, ``manifest.json`` present and readable, every listed
    file present with its size and digest, and no unlisted shard file.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return [f"{ckpt_dir}: not a directory"]
    problems: list[str] = []
    meta = ckpt_dir / META_FILE
    if not meta.is_file():
        problems.append(f"{META_FILE} is missing (an interrupted save, or deleted)")
    else:
        try:
            json.loads(meta.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            problems.append(f"{META_FILE} is not valid JSON ({type(e).__name__})")
    mpath = ckpt_dir / MANIFEST_FILE
    if not mpath.is_file():
        problems.append(f"{MANIFEST_FILE} is missing: the files cannot be checked")
        return problems
    try:
        manifest = json.loads(mpath.read_bytes().decode("utf-8"))
        listed: dict[str, dict] = manifest["files"]
        if manifest["hash"] != HASH_NAME:
            return [*problems, f"{MANIFEST_FILE}: unknown hash {manifest['hash']!r}"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        return [*problems, f"{MANIFEST_FILE} is unreadable ({type(e).__name__})"]
    for rel, rec in sorted(listed.items()):
        p = ckpt_dir / rel
        if not p.is_file():
            problems.append(f"{rel}: missing")
            continue
        size = p.stat().st_size
        if size != rec["size"]:
            problems.append(f"{rel}: {size} bytes, {rec['size']} when saved (truncated or overwritten)")
        elif file_digest(p) != rec["digest"]:
            problems.append(f"{rel}: checksum mismatch (the content changed after the save)")
    extra = [
        str(p.relative_to(ckpt_dir)) for p in _files(ckpt_dir) if str(p.relative_to(ckpt_dir)) not in listed
    ]
    if extra:
        problems.append(f"files not in the manifest: {extra[:5]}")
    return problems


def verify_many(path: str | Path, *, console) -> bool:
    """``dhp checkpoint verify``: verify ``path`` (a checkpoint, a run dir, its ``checkpoints/``
    or a run name's dir), print one line per checkpoint; True when every one verifies."""

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such path. Fix: pass a step_XXXXXX checkpoint or a run directory.")
    if path.name.startswith("step_") and ".tmp-" not in path.name:
        found = [path]
    else:
        found = sorted(
            p
            for p in path.rglob("step_*")
            if p.is_dir() and ".tmp-" not in p.name and p.parent.name == "checkpoints"
        )
    if not found:
        raise CheckpointError(
            f"{path} holds no step_XXXXXX checkpoint. Fix: pass a checkpoint or a run directory."
        )
    ok = True
    for p in found:
        problems = verify_checkpoint(p)
        ok &= not problems
        console.print(
            f"{'OK  ' if not problems else 'FAIL'} {p}" + "".join(f"\n     - {x}" for x in problems)
        )
    return ok
