"""Warmup + cosine LR schedule."""

import itertools
import math

import pytest

from dhp.runtime.schedule import WarmupCosine

pytestmark = pytest.mark.unit


def test_warmup_then_cosine_to_floor_and_resumable_state():
    s = WarmupCosine(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    lrs = [s.next_lr() for _ in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and math.isclose(lrs[-1], 0.1, rel_tol=1e-12)
    assert math.isclose(lrs[9], 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 9)), rel_tol=1e-12)
    assert all(a >= b for a, b in itertools.pairwise(lrs[4:]))
    resumed = WarmupCosine(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    resumed.load_state_dict({"step": 6})
    assert [resumed.next_lr() for _ in range(8)] == lrs[6:]


def test_no_warmup_starts_at_peak():
    assert WarmupCosine(lr=2.0, warmup_steps=0, total_steps=3, min_lr_ratio=0.5).next_lr() == 2.0
