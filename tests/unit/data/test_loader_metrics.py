"""The loader's own figures (wait, samples/s, workers) and the one-time data-wait warning."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import pytest

from dhp.config.schema import DataConfig, SyntheticData, TrainConfig
from dhp.data.loader import build_loader
from dhp.errors import ConfigError

pytestmark = pytest.mark.unit


def _loader(tiny_model, **kw):
    data = replace(DataConfig(kind="synthetic", synthetic=SyntheticData(num_samples=8, patches=64)), **kw)
    train = TrainConfig(global_batch_size=2, micro_batch_size=1)
    model = replace(tiny_model, path=None)
    return build_loader(
        data=data, model=model, train=train, dp_size=1, patch_seq_len=4096, token_seq_len=4096
    )


def test_a_data_bound_loop_is_reported_once_with_the_fix(tiny_model, caplog):
    loader = _loader(
        tiny_model, prefetch=False, num_workers=0
    )  # inline: every step waits for all of its data
    with caplog.at_level(logging.WARNING, logger="dhp.data"):
        steps = [next(loader) for _ in range(5)]
    warned = [r.getMessage() for r in caplog.records if r.name == "dhp.data"]
    assert len(warned) == 1 and warned[0].startswith("data: step 3 waited")
    assert "data.num_workers" in warned[0] and "data.max_pixels" in warned[0]
    m = steps[-1].metrics
    assert (
        set(m) == {"wait_s", "samples_per_s", "workers", "epoch"}
        and m["workers"] == 1.0
        and m["samples_per_s"] > 0
    )


@pytest.mark.slow
def test_a_loop_that_never_waits_is_not_reported(tiny_model, caplog):
    loader = _loader(tiny_model, prefetch=True)
    with caplog.at_level(logging.WARNING, logger="dhp.data"):
        for _ in range(5):
            next(loader)
            time.sleep(1.0)  # the "step": far longer than building the next one in the background
    loader.close()
    assert not [r for r in caplog.records if r.name == "dhp.data"]


def test_engine_and_depth_are_checked(tiny_model):
    with pytest.raises(ConfigError, match=r"data\.engine"):
        _loader(tiny_model, engine="spark")
    with pytest.raises(ConfigError, match=r"data\.prefetch_depth"):
        _loader(tiny_model, prefetch_depth=0)
