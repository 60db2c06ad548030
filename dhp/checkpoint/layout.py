"""Checkpoint directories: naming, atomic commit, keep-last-K pruning and resume discovery.

Pure filesystem logic run by the driver (no torch.distributed). A checkpoint is written into
``step_000100.tmp-<pid>/`` by every module group, then ``meta.json`` is written and the directory is
renamed to ``step_000100/`` in one ``os.rename``: readers never see a half-written checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from dhp.checkpoint.meta import META_FILE, CheckpointMeta, write_meta
from dhp.errors import CheckpointError

_STEP_RE = re.compile(r"^step_(\d{6,})$")
_TMP_RE = re.compile(r"^step_(\d{6,})\.tmp-(\d+)$")


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
    """Delete all but the newest ``keep_last`` complete checkpoints, and temp dirs of dead writers.

    ``keep_last <= 0`` keeps everything. Returns the deleted paths.
    """
    removed: list[Path] = []
    complete = list_checkpoints(checkpoints_dir)
    if keep_last > 0:
        for _, p in complete[:-keep_last]:
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def find_latest_checkpoint(*, output_dir: str | Path, name: str) -> Path | None:
    """The newest complete checkpoint of run ``name`` over all its timestamped run dirs, or None.

    Highest step wins; among equal steps, the later run directory (timestamps sort by name).
    Temp dirs (``*.tmp-*``) and dirs without ``meta.json`` are ignored.
    """
    root = Path(output_dir) / name
    if not root.is_dir():
        return None
    best: tuple[int, str, Path] | None = None
    for run_dir in root.iterdir():
        for step, p in list_checkpoints(run_dir / "checkpoints"):
            key = (step, run_dir.name, p)
            if best is None or key[:2] > best[:2]:
                best = key
    return None if best is None else best[2]


def resolve_resume(resume: str | None, *, output_dir: str | Path, name: str) -> Path | None:
    """Turn ``train.resume`` into a checkpoint dir: None -> None, ``"auto"`` -> newest (or None), else a path.

    A path must be a complete checkpoint (``step_XXXXXX`` with ``meta.json``); a run's
    ``checkpoints/`` dir or a run dir resolves to its newest complete checkpoint.
    """
    if resume is None:
        return None
    if resume == "auto":
        return find_latest_checkpoint(output_dir=output_dir, name=name)
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(
            f"train.resume = {resume!r}: no such path. Fix: pass a step_XXXXXX checkpoint directory, "
            "or train.resume=auto to pick the newest checkpoint of this run name."
        )
    if (path / META_FILE).is_file():
        return path
    for candidate in (path, path / "checkpoints"):
        found = list_checkpoints(candidate)
        if found:
            return found[-1][1]
    raise CheckpointError(
        f"train.resume = {resume!r}: not a complete checkpoint ({META_FILE} missing; an interrupted save "
        "leaves a *.tmp-<pid> dir) and holds no complete step_XXXXXX checkpoint. "
        "Fix: pass a complete checkpoint directory or use train.resume=auto."
    )
