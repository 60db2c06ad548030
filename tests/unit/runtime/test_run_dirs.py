"""Which run directory a resume writes into (``dhp.runtime.loop.rundirs``): its own when the checkpoint
is one of this run name's, a new one otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from dhp.runtime.loop.rundirs import continued_run_dir

pytestmark = pytest.mark.unit


def test_a_checkpoint_of_this_run_name_continues_its_run_dir(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "a" / "20261205-100000"
    ckpt = run / "checkpoints" / "step_000005"
    ckpt.mkdir(parents=True)
    assert continued_run_dir(ckpt, output_dir=str(tmp_path / "runs"), name="a") == run
    # another run name's checkpoint, or one outside a run's checkpoints/, starts a new run dir
    assert continued_run_dir(ckpt, output_dir=str(tmp_path / "runs"), name="b") is None
    assert continued_run_dir(ckpt, output_dir=str(tmp_path / "elsewhere"), name="a") is None
    loose = tmp_path / "runs" / "a" / "step_000005"
    loose.mkdir()
    assert continued_run_dir(loose, output_dir=str(tmp_path / "runs"), name="a") is None
    assert continued_run_dir(None, output_dir=str(tmp_path / "runs"), name="a") is None
