"""Asynchronous module save (one process, no process group): the call returns once the state is
staged, so changing the parameters right after does not change what is written; the files are
the synchronous save's; a second save while one is in flight is refused; a finished save keeps
being reported as done (a poll never consumes it); a failed write raises a CheckpointError naming
the path once, then the rank is free again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_tiny import tiny_text_model

from dhp.checkpoint import load_module_state, save_module_state
from dhp.checkpoint.async_state import async_save_status, save_module_state_async
from dhp.errors import CheckpointError

pytestmark = pytest.mark.unit


def _opt(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.arange(8)[None]).last_hidden_state.sum().backward()
    opt.step()
    return opt


def test_async_save_writes_the_staged_state_and_loads_back(tmp_path: Path) -> None:
    model = tiny_text_model(seed=0)
    opt = _opt(model)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    staging_s = save_module_state_async(tmp_path / "a", model=model, optimizer=opt, extra={"x": 1})
    assert staging_s >= 0
    with torch.no_grad():  # training goes on at once: the save must hold the staged copy
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(CheckpointError, match="still in flight"):
        save_module_state_async(tmp_path / "b", model=model, optimizer=opt)
    status = async_save_status(wait=True)
    assert status["done"] and status["write_s"] >= 0 and status["path"] == str(tmp_path / "a")
    assert async_save_status(wait=False) == status  # a finished save stays reported until the next
    save_module_state(tmp_path / "s", model=tiny_text_model(seed=0), optimizer=None)
    names = lambda d: sorted(p.name for p in d.iterdir())  # noqa: E731
    assert names(tmp_path / "a") == names(tmp_path / "s")
    fresh = tiny_text_model(seed=1)
    extra = load_module_state(tmp_path / "a", model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()))
    assert extra == {"x": 1}
    got = fresh.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_failed_async_write_is_a_checkpoint_error_and_frees_the_rank(tmp_path: Path) -> None:
    model = tiny_text_model(seed=0)
    target = tmp_path / "bad"
    (target / "__0_0.distcp").mkdir(parents=True)  # the shard file's name is taken by a directory
    save_module_state_async(target, model=model, optimizer=None)  # staging succeeds
    with pytest.raises(CheckpointError, match=r"asynchronous save to .*bad failed"):
        async_save_status(wait=True)
    assert async_save_status(wait=False) is None  # reported once, then forgotten
    save_module_state_async(tmp_path / "ok", model=model, optimizer=None)
    assert async_save_status(wait=True)["done"]
