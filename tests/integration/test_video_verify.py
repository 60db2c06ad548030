"""``dhp verify`` through the real CLI with video AND packing: vision SP 2 + LLM TP 2 with SP against
the unsplit transformers model.

tiny_vlm_video (every sample: an image and a 4-frame video, 0.5 s per temporal patch) with
``data.packing=true``: both samples of a micro-batch share one LLM row, the reference runs each
sample alone with ``pixel_values_videos``/``second_per_grid_ts``. Tolerances: dhp verify's own
(loss 1e-5 relative, every gradient element 1e-4 absolute). Slow tier: the one-process parities in
tests/parity/test_video.py and tests/parity/test_packing.py cover both features fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_verify_video_packed_sp2_tp2() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dhp.cli",
            "verify",
            "conf=tiny_vlm_video",
            "steps=1",
            "data.packing=true",
            "data.max_tokens=512",
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "PASS" in proc.stdout and "over 1 step(s)" in proc.stdout, out[-4000:]
