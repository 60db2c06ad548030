"""Disaggregated groups pipeline micro-batches: the encoder's forward of micro-batch i+1 runs while
the LLM works on micro-batch i (wall-clock intervals recorded by the workers overlap).

The LLM's forward of micro-batch 0 is held 1 s (``DHP_INJECT_FAULT=delay:...``): the tiny model's
own work takes a few ms, less than the driver's and Ray's latency on a loaded 2-core box, so without
the hold the order of two ms-long intervals would be a race, not the schedule."""

from __future__ import annotations

import pytest
from plans import ALL_ONE

from dhp.data import build_run_loader
from dhp.plan import compile_plan
from dhp.plan.compile import module_layouts
from dhp.runtime import Trainer
from dhp.runtime.actors.failures import DELAY_S, FAULT_ENV
from dhp.validation import load_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_encoder_forward_of_next_micro_batch_overlaps_llm_work(ray_local, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "delay:llm/0:forward:2")  # micro-batch 0 of the measured step
    cfg = load_config(
        "tiny_vlm",
        [
            *ALL_ONE,
            "train.micro_batch_size=1",
        ],
    )  # global batch 4 -> 4 micro-batches
    trainer = Trainer(cfg, compile_plan(cfg))
    try:
        loader = build_run_loader(cfg, module_layouts(cfg))
        trainer.step(next(loader), lr=1e-3)  # warm-up (first calls import and allocate)
        res = trainer.step(next(loader), lr=1e-3)
    finally:
        trainer.close()
    vis = {m: (a, b) for name, m, a, b in res.stats["vision"][0]["events"] if name == "produce"}
    llm = {m: (a, b) for name, m, a, b in res.stats["llm"][0]["events"] if name == "consume"}
    assert sorted(vis) == sorted(llm) == [0, 1, 2, 3]
    assert llm[0][1] - llm[0][0] >= DELAY_S  # the hold took effect
    # F1 is issued before the LLM's call on 0 and the encoder is idle after F0, so F1 runs during
    # L0; a driver that waited for L0 before issuing F1 would start F1 after L0 ended.
    assert vis[1][0] < llm[0][1], (vis, llm)
    assert vis[0][1] <= llm[0][0] + 1e-3  # L0's compute starts only once F0's rows arrived
