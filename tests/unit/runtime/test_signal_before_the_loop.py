"""A SIGTERM that lands after ``dhp train`` installed its handling but before an attempt's own
handling (while the data is being opened, before the run dir) ends the run as a SIGTERM: ``result.signal`` is SIGTERM
(the CLI exits 143), not a KeyboardInterrupt escaping to the CLI's Ctrl-C exit 130; no Ray is left.

The signal is real (``os.kill`` of this process through the run's own handler); the patched loader
only chooses the moment it arrives.
"""

from __future__ import annotations

import io
import os
import signal
import time

import pytest
import ray
from rich.console import Console

import dhp.data
from dhp.runtime.loop.train import train
from dhp.validation import load_config

pytestmark = pytest.mark.unit


def test_sigterm_while_the_loader_builds_ends_the_run_as_sigterm(monkeypatch, tmp_path) -> None:
    def build_run_data(config, layouts):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(2)  # the handler runs here, at the next bytecode boundary
        raise AssertionError("the SIGTERM did not reach the run's handler")

    monkeypatch.setattr(dhp.data, "build_run_data", build_run_data)
    cfg = load_config("tiny_vlm", [f"train.output_dir={tmp_path}", "train.steps=2"])
    out = io.StringIO()
    before = signal.getsignal(signal.SIGTERM)
    try:
        result = train(cfg, console=Console(file=out))
    except KeyboardInterrupt:
        pytest.fail("the SIGTERM escaped train() as a KeyboardInterrupt (the CLI would exit 130, not 143)")
    assert result.interrupted and result.signal == signal.SIGTERM
    assert "interrupted before a step could run" in out.getvalue()
    assert not ray.is_initialized()
    assert result.run_dir is None and not any(tmp_path.iterdir())  # no run dir: nothing ran
    assert signal.getsignal(signal.SIGTERM) is before  # the run's handlers are taken back
