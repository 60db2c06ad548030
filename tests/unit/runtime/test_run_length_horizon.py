"""The run's length from train.steps or train.epochs, and a resume's LR horizon (keep or new)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dhp.errors import ConfigError
from dhp.runtime.loop.horizon import apply, horizon_change
from dhp.runtime.loop.run_length import run_length
from dhp.runtime.loop.schedule import WarmupCosine

pytestmark = pytest.mark.unit


def _train(**kw):
    base = {"steps": 0, "epochs": 0.0, "global_batch_size": 8, "warmup_steps": 0, "warmup_ratio": 0.0}
    return SimpleNamespace(**(base | kw))


def test_epochs_make_ceil_of_samples_over_batch_and_a_warmup_ratio_of_them():
    n = run_length(_train(epochs=3, warmup_ratio=0.1), samples_per_epoch=100)
    assert (n.steps, n.warmup_steps, n.epochs) == (38, 4, 3.0)  # ceil(300 / 8); round(3.8)
    assert "train.epochs=3: 3 x 100 samples / 8 per step = 38 steps" in n.describe()
    s = run_length(_train(steps=10, warmup_steps=2), samples_per_epoch=40)
    assert (s.steps, s.warmup_steps, s.epochs) == (10, 2, 0.0) and s.epoch_at(10) == 2.0


def test_a_warmup_longer_than_an_epochs_run_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"train.warmup_steps = 50: longer than the run: 4 steps"):
        run_length(_train(epochs=1, warmup_steps=50), samples_per_epoch=32)


def _sched(total: int) -> WarmupCosine:
    return WarmupCosine(lr=1e-3, warmup_steps=2, total_steps=total, min_lr_ratio=0.1)


def test_resume_keeps_the_checkpoint_horizon_by_default_and_says_so():
    run = _sched(20)
    for _ in range(10):
        run.next_lr()
    saved = run.state_dict()
    want = run.lr_at(10)  # what the uninterrupted 20-step run gives step 11
    longer = _sched(30)  # the resume asks for 30 steps
    change = horizon_change(saved, longer, mode="keep")
    assert change is not None and change.kept and change.checkpoint == (20, 2) and change.run == (30, 2)
    assert change.lr_checkpoint == want != change.lr_run
    apply(longer, saved, change)
    assert longer.next_lr() == want and longer.horizon() == (20, 2)
    assert "keeps the checkpoint's horizon (train.resume_horizon=keep), step 11 runs at lr" in change.line()
    assert change.record()["kept"] is True and change.record()["run_total_steps"] == 30


def test_resume_horizon_new_moves_the_curve_and_says_by_how_much():
    saved = {"step": 10, "kind": "cosine", "total_steps": 20, "warmup_steps": 2}
    longer = _sched(30)
    change = horizon_change(saved, longer, mode="new")
    apply(longer, saved, change)
    assert not change.kept and longer.next_lr() == change.lr_run == _sched(30).lr_at(10)
    assert "moves from the checkpoint's 20 steps (warmup 2) to the run's 30 steps" in change.line()


def test_same_horizon_or_an_older_checkpoint_changes_nothing():
    assert horizon_change({"step": 3, "total_steps": 20, "warmup_steps": 2}, _sched(20), mode="keep") is None
    assert horizon_change({"step": 3}, _sched(30), mode="keep") is None  # saved before horizons were
