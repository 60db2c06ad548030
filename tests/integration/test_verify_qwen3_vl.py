"""``dhp verify`` on tiny_qwen3_vl through the real CLI: Qwen3-VL's plan against the unsplit transformers model.

Vision Ulysses SP=2 sends each rank's rows of image_embeds and of both DeepStack features; the LLM gets all
1 + K edges and sends every edge's gradient back. Collocated with LLM TP=2, and disaggregated with unequal
rank counts (2 vision ranks : 1 LLM rank). Tolerance: verify's own (loss 1e-5 relative, every gradient
1e-4 absolute, fp32); measured max|dg| ~5e-7.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _verify(*args: str) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    proc = subprocess.run(
        [sys.executable, "-m", "dhp.cli", "verify", "conf=tiny_qwen3_vl", "steps=2", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "PASS" in proc.stdout and "over 2 step(s)" in proc.stdout, out[-4000:]


def test_qwen3_vl_verify_collocated_sp2_tp2() -> None:
    _verify()


def test_qwen3_vl_verify_disaggregated_two_vision_ranks_one_llm_rank() -> None:
    _verify("placement=disaggregated", "modules.llm.gpus=1", "modules.llm.parallel.tp=1")
