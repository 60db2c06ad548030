"""``train.keep_best``: the checkpoint of the lowest eval loss, kept beside the newest ``keep_last``.

``checkpoints/best`` is a symlink to that ``step_XXXXXX`` directory (``dhp export RUN/checkpoints/best
OUT`` exports it) and ``checkpoints/best.json`` says why: ``{"step", "eval_loss"}``. Pruning never
deletes the checkpoint ``best`` points to (:func:`protected_steps`). Both are replaced atomically (a
rename), so a reader sees the old best or the new one. Pure filesystem logic, driver side.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

BEST = "best"
BEST_FILE = "best.json"


def read_best(checkpoints_dir: Path) -> dict[str, Any] | None:
    """``{"step", "eval_loss"}`` of the best checkpoint so far, or None (none kept, or unreadable)."""
    path = Path(checkpoints_dir) / BEST_FILE
    try:
        best = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return best if isinstance(best, dict) and isinstance(best.get("step"), int) else None


def protected_steps(checkpoints_dir: Path) -> set[int]:
    """The steps pruning keeps whatever ``keep_last`` says: the one ``best`` names."""
    best = read_best(checkpoints_dir)
    return set() if best is None else {best["step"]}


def mark_best(checkpoint: Path, *, eval_loss: float) -> Path:
    """Point ``<checkpoints>/best`` at the committed ``checkpoint`` and record its eval loss."""
    root = checkpoint.parent
    step = int(checkpoint.name.removeprefix("step_"))
    tmp_file = root / f"{BEST_FILE}.tmp-{os.getpid()}"
    tmp_file.write_text(json.dumps({"step": step, "eval_loss": eval_loss}) + "\n", encoding="utf-8")
    tmp_link = root / f"{BEST}.tmp-{os.getpid()}"
    if tmp_link.is_symlink() or tmp_link.exists():
        tmp_link.unlink()
    tmp_link.symlink_to(checkpoint.name, target_is_directory=True)
    os.replace(tmp_file, root / BEST_FILE)  # the record first: pruning reads it
    os.replace(tmp_link, root / BEST)
    return root / BEST
