"""Warmup + cosine LR schedule."""

import itertools
import math

import pytest

from dhp.runtime.loop.schedule import WarmupCosine

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


def _run(kind: str, **kw) -> list[float]:
    from types import SimpleNamespace

    from dhp.runtime.loop.schedule import make_schedule

    train = SimpleNamespace(
        lr=1.0, min_lr_ratio=0.1, lr_schedule=kind, decay_ratio=kw.pop("decay_ratio", 0.1)
    )
    s = make_schedule(train, **kw)
    return [s.next_lr() for _ in range(kw["total_steps"])]


def test_each_schedule_after_the_same_warmup():
    for kind in ("cosine", "linear", "constant", "wsd"):
        assert _run(kind, total_steps=12, warmup_steps=2)[:2] == [0.5, 1.0], kind
    linear = _run("linear", total_steps=12, warmup_steps=2)
    assert linear[2] == 1.0 and math.isclose(linear[-1], 0.1) and math.isclose(linear[7], 1.0 - 0.9 * 5 / 9)
    assert _run("constant", total_steps=12, warmup_steps=2)[2:] == [1.0] * 10
    # wsd: stable at lr, then the last round(0.25 * 12) = 3 steps decay linearly to the floor
    wsd = _run("wsd", total_steps=12, warmup_steps=2, decay_ratio=0.25)
    assert wsd[2:9] == [1.0] * 7 and math.isclose(wsd[9], 1.0) and math.isclose(wsd[10], 0.55)
    assert math.isclose(wsd[11], 0.1)


def test_state_names_the_horizon_and_resumes_the_step():
    from dhp.runtime.loop.schedule import WarmupLinear

    s = WarmupLinear(lr=1.0, warmup_steps=2, total_steps=10, min_lr_ratio=0.0)
    for _ in range(3):
        s.next_lr()
    assert s.state_dict() == {"step": 3, "kind": "linear", "total_steps": 10, "warmup_steps": 2}
    assert s.lr_at(20) == 0.0  # past the horizon: the floor
