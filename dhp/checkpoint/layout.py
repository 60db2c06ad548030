"""Checkpoint directories: naming, atomic commit, keep-last-K pruning and resume discovery.

Pure filesystem logic run by the driver (no torch.distributed). A checkpoint is written into
``step_000100.tmp-<pid>/`` by every module group, then ``meta.json`` is written and the directory is
renamed to ``step_000100/`` in one ``os.rename``: readers never see a half-written checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from dhp.checkpoint.best import protected_steps
from dhp.checkpoint.manifest import verify_checkpoint, write_manifest
from dhp.checkpoint.meta import META_FILE, CheckpointMeta, write_meta
from dhp.errors import CheckpointError

_STEP_RE = re.compile(r"^step_(\d{6,})$")
_TMP_RE = re.compile(r"^step_(\d{6,})\.tmp-(\d+)$")
_ANY_TMP_RE = re.compile(r"^step_(\d{6,})\.tmp-(\d+)(-old)?$")


def step_dir_name(step: int) -> str:
    """``step_000100`` for step 100."""
    return f"step_{step:06d}"


def begin_checkpoint(checkpoints_dir: Path, *, step: int) -> Path:
    """Create and return the temp directory ``step_XXXXXX.tmp-<pid>/`` that groups save into."""
    checkpoints_dir = Path(checkpoints_dir)
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    tmp = checkpoints_dir / f"{step_dir_name(step)}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_checkpoints(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (``step_XXXXXX`` with ``meta.json``) in one run's directory, oldest first."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for p in checkpoints_dir.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / META_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def prune_checkpoints(checkpoints_dir: Path, *, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (and the best one, which
    ``train.keep_best`` marks: ``dhp.checkpoint.best``), and temp dirs of dead writers.

    ``keep_last <= 0`` keeps everything. Returns the deleted paths.
    """
    removed: list[Path] = []
    complete = list_checkpoints(checkpoints_dir)
    keep = protected_steps(checkpoints_dir)
    if keep_last > 0:
        for step, p in complete[:-keep_last]:
            if step in keep:
                continue
            shutil.rmtree(p)
            removed.append(p)
    for p in Path(checkpoints_dir).iterdir():
        m = _TMP_RE.match(p.name)
        if m and int(m.group(2)) != os.getpid() and not _pid_alive(int(m.group(2))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def commit_checkpoint(tmp: Path, *, meta: CheckpointMeta, keep_last: int) -> Path:
    """Write ``meta.json`` into ``tmp``, rename it to its final ``step_XXXXXX`` name, prune old ones.

    Call only after every module group finished saving into ``tmp/<module>/``. If a checkpoint of
    the same step already exists (a resumed run saving again), it is replaced only after the new
    one is complete. Returns the final path.
    """
    tmp = Path(tmp)
    m = _TMP_RE.match(tmp.name)
    if m is None or int(m.group(1)) != meta.step:
        raise CheckpointError(
            f"{tmp} is not a temp checkpoint dir for step {meta.step} (from begin_checkpoint)."
        )
    missing = [name for name in meta.modules if not (tmp / name).is_dir()]
    if missing:
        raise CheckpointError(
            f"{tmp}: module group(s) {missing} wrote nothing; the checkpoint is not committed."
        )
    write_manifest(tmp)
    write_meta(tmp, meta)
    final = tmp.parent / step_dir_name(meta.step)
    if final.exists():
        old = tmp.parent / f"{final.name}.tmp-{os.getpid()}-old"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(tmp.parent)
    prune_checkpoints(tmp.parent, keep_last=keep_last)
    return final


def remove_own_temps(checkpoints_dir: str | Path) -> list[Path]:
    """Delete this process's temp checkpoint dirs (``*.tmp-<this pid>``, ``-old`` included) in one
    run's ``checkpoints/``. Call only once the writers are gone (the groups torn down): a save cut by a
    second signal removes its temp dir at once, but a rank still writing into it can recreate it until
    the rank is stopped. Returns what was removed."""
    removed: list[Path] = []
    ckdir = Path(checkpoints_dir)
    if not ckdir.is_dir():
        return removed
    for p in sorted(ckdir.iterdir()):
        m = _ANY_TMP_RE.match(p.name)
        if m and p.is_dir() and int(m.group(2)) == os.getpid():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def remove_stale_temps(output_dir: str | Path, *, name: str) -> list[Path]:
    """Delete temp checkpoint dirs (``*.tmp-<pid>``) of writers that are no longer alive, in every
    run dir of ``name``; returns what was removed so the caller can say so."""
    removed: list[Path] = []
    root = Path(output_dir) / name
    if not root.is_dir():
        return removed
    for ckdir in sorted(root.glob("*/checkpoints")):
        for p in sorted(ckdir.iterdir()):
            m = _ANY_TMP_RE.match(p.name)
            if (
                m
                and p.is_dir()
                and (int(m.group(2)) != os.getpid() or m.group(3))
                and not (int(m.group(2)) != os.getpid() and _pid_alive(int(m.group(2))))
            ):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_candidates(*, output_dir: str | Path, name: str) -> list[Path]:
    """Every ``step_XXXXXX`` dir (complete or not) of run ``name``, newest first.

    Highest step first; among equal steps, the later run directory (timestamps sort by name).
    Temp dirs (``*.tmp-*``) are not candidates.
    """
    root = Path(output_dir) / name
    if not root.is_dir():
        return []
    found = []
    for ckdir in root.glob("*/checkpoints"):
        for p in ckdir.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), ckdir.parent.name, p))
    return [p for *_, p in sorted(found, reverse=True)]


def find_latest_checkpoint(
    *, output_dir: str | Path, name: str, on_skip: Callable[[Path, list[str]], None] | None = None
) -> Path | None:
    """The newest checkpoint of run ``name`` that verifies (meta.json + manifest checksums), or None.

    Each newer one that fails verification is passed to ``on_skip(path, problems)`` (the caller
    says which one it skipped and why) before the next older one is tried.
    """
    for p in checkpoint_candidates(output_dir=output_dir, name=name):
        problems = verify_checkpoint(p)
        if not problems:
            return p
        if on_skip is not None:
            on_skip(p, problems)
    return None


def resolve_resume(
    resume: str | None,
    *,
    output_dir: str | Path,
    name: str,
    on_skip: Callable[[Path, list[str]], None] | None = None,
) -> Path | None:
    """Turn ``train.resume`` into a checkpoint dir: None -> None, ``"auto"`` -> newest (or None), else a path
    (:func:`resolve_checkpoint`)."""
    if resume is None:
        return None
    if resume == "auto":
        return find_latest_checkpoint(output_dir=output_dir, name=name, on_skip=on_skip)
    return resolve_checkpoint(
        resume,
        arg="train.resume",
        other="or train.resume=auto to pick the newest checkpoint of this run name",
    )


def resolve_checkpoint(path_arg: str | Path, *, arg: str, other: str) -> Path:
    """The complete checkpoint ``path_arg`` names: a ``step_XXXXXX`` dir with ``meta.json`` that verifies,
    or a run's ``checkpoints/`` dir or run dir, which resolve to their newest complete checkpoint.
    CheckpointError otherwise, naming the caller's own argument ``arg`` (``train.resume``,
    ``dhp export CHECKPOINT``) and ending its fix with ``other`` (the caller's alternative)."""
    path = Path(path_arg)
    if not path.exists():
        raise CheckpointError(
            f"{arg} = {str(path_arg)!r}: no such path. Fix: pass a step_XXXXXX checkpoint directory "
            f"or a run directory, {other}."
        )
    if (path / META_FILE).is_file():
        return _verified(path, other=other)
    for candidate in (path, path / "checkpoints"):
        found = list_checkpoints(candidate)
        if found:
            return _verified(found[-1][1], other=other)
    raise CheckpointError(
        f"{arg} = {str(path_arg)!r}: not a complete checkpoint ({META_FILE} missing; an interrupted save "
        "leaves a *.tmp-<pid> dir) and holds no complete step_XXXXXX checkpoint. "
        f"Fix: pass a complete checkpoint directory, {other}."
    )


def _verified(path: Path, *, other: str) -> Path:
    """``path`` if it verifies, else CheckpointError listing the problems (an explicit path never
    falls back silently)."""
    problems = verify_checkpoint(path)
    if problems:
        raise CheckpointError(
            f"checkpoint {path} fails verification:\n  - " + "\n  - ".join(problems) + "\n  Fix: use "
            f"an older checkpoint (`dhp checkpoint verify RUN_DIR` lists them), {other}."
        )
    return path
