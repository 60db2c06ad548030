"""An eval pass leaves a rank as it found it (observed directly: equal losses alone would not show
it): the RNG streams, each submodule's train/eval mode, the step's timers and events and the expert
counters come back after ``eval_end``, whatever the pass drew or ran."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dhp.runtime.handoff.transport import CpuTransport
from dhp.runtime.loop.eval_worker import EvalMethods

pytestmark = pytest.mark.unit


def test_eval_begin_and_end_restore_rng_modes_timers_and_counters():
    module = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    module[1].eval()  # a submodule left in eval mode on purpose stays so
    counts = torch.ones(2, 3, dtype=torch.int64)
    rank = SimpleNamespace(
        module=module,
        _timers={"fwd_s": 1.0},
        _events=[("produce", 0, 0.0, 1.0)],
        expert_load=SimpleNamespace(counts=counts),
        channel=CpuTransport(),
        device=torch.device("cpu"),
    )
    torch.manual_seed(5)
    want = torch.rand(4)
    torch.manual_seed(5)
    EvalMethods.eval_begin(rank)
    assert not module.training and rank.expert_load.counts is None  # the pass counts apart
    torch.rand(100)  # whatever the pass draws
    rank._timers["fwd_s"] += 9.0
    rank._events.append(("eval", 0, 1.0, 2.0))
    rank.expert_load.counts = torch.zeros(2, 3, dtype=torch.int64)
    EvalMethods.eval_end(rank)
    assert torch.equal(torch.rand(4), want)  # the stream goes on as without the pass
    assert module.training and module[0].training and not module[1].training
    assert rank._timers == {"fwd_s": 1.0} and len(rank._events) == 1 and rank.expert_load.counts is counts
