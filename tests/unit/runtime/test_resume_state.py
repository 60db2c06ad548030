"""What a resume restores on the driver, observed directly (the losses alone may not show it):
the loader's position (the next batch is the one the uninterrupted run would draw), the LR
schedule (the next lr), and the driver RNG. The module groups' own load is the Trainer's
(covered end to end by the integration resume tests); here a recorder stands in for it."""

from __future__ import annotations

import io
import random

import pytest
import torch

from dhp.checkpoint import CheckpointMeta, capture_rng_state
from dhp.data import build_run_loader
from dhp.plan.compile import module_layouts
from dhp.runtime.loop.schedule import WarmupCosine
from dhp.runtime.loop.train import _resume
from dhp.validation import load_config

pytestmark = pytest.mark.unit


class _Groups:
    """Records the checkpoint dir the groups were asked to load."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def load_modules(self, root: str) -> dict[str, bool]:
        self.loaded.append(root)
        return {"vision": True, "llm": True}


def _ids(step) -> list:
    return [sid for mb in step.micro_batches for b in mb for sid in b.sample_ids]


def test_resume_restores_data_position_lr_schedule_and_driver_rng(tmp_path) -> None:
    from rich.console import Console

    cfg = load_config("tiny_vlm", ["train.steps=20", "train.warmup_steps=3"])
    t = cfg.train

    def schedule() -> WarmupCosine:
        return WarmupCosine(
            lr=t.lr, warmup_steps=t.warmup_steps, total_steps=t.steps, min_lr_ratio=t.min_lr_ratio
        )

    loader, sched = build_run_loader(cfg, module_layouts(cfg)), schedule()
    for _ in range(3):
        next(loader), sched.next_lr()
    torch.manual_seed(123)
    random.seed(7)
    meta = CheckpointMeta(
        step=3,
        data_state=loader.state_dict(),
        driver_rng=capture_rng_state(),
        plan={},
        config_hash="",
        model_hash="",
        modules={},
        scheduler_state=sched.state_dict(),
    )
    want_batch, want_lr = _ids(next(loader)), sched.next_lr()
    want_rand = (torch.rand(3).tolist(), random.random())
    assert (
        _ids(next(build_run_loader(cfg, module_layouts(cfg)))) != want_batch
    )  # a fresh loader would draw another batch
    assert schedule().next_lr() != want_lr  # and a fresh schedule another lr

    fresh_loader, fresh_sched, groups = build_run_loader(cfg, module_layouts(cfg)), schedule(), _Groups()
    torch.manual_seed(999)
    random.seed(999)
    quiet = Console(file=io.StringIO())
    start = _resume(groups, tmp_path, (meta, []), loader=fresh_loader, schedule=fresh_sched, console=quiet)
    assert start == 3 and groups.loaded == [str(tmp_path)]
    assert _ids(next(fresh_loader)) == want_batch
    assert fresh_sched.next_lr() == want_lr
    assert (torch.rand(3).tolist(), random.random()) == want_rand
