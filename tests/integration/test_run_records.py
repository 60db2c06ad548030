"""A run's directory tells how it ended: a run killed by a bad sample is ``failed`` in ``dhp runs``
with its reason and ``traceback.txt``; a config or data error found while the data is opened leaves
no run directory at all (Ray, gloo, the tiny Qwen2.5-VL on real photos)."""

from __future__ import annotations

import io

import pytest
from plans import ALL_ONE
from rich.console import Console
from sft import llamafactory_file
from typer.testing import CliRunner

from dhp.cli import app
from dhp.errors import ConfigError, DataError
from dhp.metrics.rundir import read_run_log
from dhp.metrics.runs import read_run
from dhp.runtime.loop.train import train
from dhp.validation import load_config

pytestmark = pytest.mark.integration


def _config(tmp_path, data, *overrides):
    return load_config(
        "tiny_vlm",
        [
            "name=r",
            f"train.output_dir={tmp_path / 'runs'}",
            f"data.path={data}",
            "data.shuffle=false",
            "data.max_pixels=12544",
            "train.global_batch_size=2",
            "train.micro_batch_size=2",
            *ALL_ONE,
            *overrides,
        ],
    )


@pytest.mark.slow
def test_a_run_killed_by_a_bad_sample_is_failed_with_its_reason(ray_local, tmp_path):
    data = llamafactory_file(tmp_path / "photos.json", ["coffee.png", "moon.png", "grass.png", "coins.png"])
    data.write_text(data.read_text().replace("grass.png", "no_such_photo.png"))  # record 3: step 2
    cfg = _config(tmp_path, data, "train.steps=3")
    with pytest.raises(DataError, match=r"bad sample at .*photos\.json\[2\] \(missing_file\)"):
        train(cfg, console=Console(file=io.StringIO()))
    (run_dir,) = (tmp_path / "runs" / "r").iterdir()
    info = read_run(run_dir)
    assert info.status == "failed" and info.steps == 1
    assert "bad sample at" in info.note and "traceback.txt" in info.note
    failed = read_run_log(run_dir / "metrics.jsonl").failed
    assert failed["step"] == 2 and "recurs on every attempt" in failed["why_not_restarted"]
    tb = (run_dir / "traceback.txt").read_text()
    assert "while running step 2" in tb and "BadSampleError" in tb
    listed = CliRunner().invoke(app, ["runs", str(tmp_path / "runs")], env={"COLUMNS": "250"})
    assert listed.exit_code == 0 and "failed" in listed.output and "missing_file" in listed.output


def test_an_error_opening_the_data_leaves_no_run_dir(tmp_path):
    cfg = _config(tmp_path, tmp_path / "nothing_here.json", "train.steps=2")
    with pytest.raises((ConfigError, DataError), match=r"nothing_here\.json"):
        train(cfg, console=Console(file=io.StringIO()))
    assert not (tmp_path / "runs").exists()
    template = _config(
        tmp_path, llamafactory_file(tmp_path / "ok.json"), "train.steps=2", "data.chat_template=/none.jinja"
    )
    with pytest.raises(
        ConfigError, match=r"data\.chat_template = '/none\.jinja': cannot read the template file"
    ):
        train(template, console=Console(file=io.StringIO()))
    assert not (tmp_path / "runs").exists()
