"""train.keep_best: checkpoints/best points at the lowest eval loss's checkpoint, which pruning keeps."""

from __future__ import annotations

import pytest

from dhp.checkpoint import list_checkpoints, prune_checkpoints
from dhp.checkpoint.best import mark_best, protected_steps, read_best
from dhp.checkpoint.layout import resolve_checkpoint

pytestmark = pytest.mark.unit


def _ckpt(root, step: int):
    d = root / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text("{}")
    return d


def test_the_best_survives_keep_last_and_is_exported_by_its_link(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    for s in (10, 20, 30):
        _ckpt(root, s)
    assert read_best(root) is None and protected_steps(root) == set()
    link = mark_best(root / "step_000010", eval_loss=1.5)
    assert link.resolve() == (root / "step_000010").resolve()
    assert read_best(root) == {"step": 10, "eval_loss": 1.5}
    prune_checkpoints(root, keep_last=1)
    assert [s for s, _ in list_checkpoints(root)] == [10, 30]  # 20 pruned, the best kept
    mark_best(root / "step_000030", eval_loss=1.2)  # a better one: the old best may go now
    prune_checkpoints(root, keep_last=1)
    assert [s for s, _ in list_checkpoints(root)] == [30] and read_best(root)["step"] == 30
    monkeypatch.setattr("dhp.checkpoint.layout.verify_checkpoint", lambda p: [])
    assert (
        resolve_checkpoint(root / "best", arg="x", other="y") == root / "best"
    )  # dhp export RUN/checkpoints/best
