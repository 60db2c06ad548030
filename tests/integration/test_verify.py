"""``dhp verify`` through the real CLI on tiny_vlm: the plan against the unsplit transformers model.

Tolerances are the ones the issue fixes: loss within 1e-5 relative, every gradient element within
1e-4 absolute, 10 steps. The last test proves the comparison can fail: the same run with an
impossible gradient tolerance (1e-12; SP/TP reduce in another order, so fp32 rounding differs)
must exit 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def verify(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "dhp.cli", "verify", "conf=tiny_vlm", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _passed(proc: subprocess.CompletedProcess, steps: int) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "PASS" in proc.stdout and f"over {steps} step(s)" in proc.stdout, out[-4000:]


def test_collocated_sp2_tp2_ten_steps() -> None:
    # the recipe already turns sequence parallelism on inside the LLM's TP group; say it explicitly
    _passed(verify("steps=10", "modules.llm.parallel.sequence_parallel=true"), 10)


def test_disaggregated_sequence_parallel_selective_ac_mode_chunked() -> None:
    # vision SP=2 (full AC) beside LLM TP=2 + SP (op-level, selective AC) on disjoint ranks, and
    # a 7-token loss chunk that divides no micro-batch's label count
    _passed(
        verify(
            "steps=2",
            "placement=disaggregated",
            "modules.llm.parallel.sequence_parallel=true",
            "modules.llm.activation_checkpointing=selective",
            "modules.vision.activation_checkpointing=full",
            "modules.llm.loss_chunk_tokens=7",
        ),
        2,
    )


def test_disaggregated_vision1_llm_tp2() -> None:
    _passed(
        verify(
            "steps=10", "placement=disaggregated", "modules.vision.gpus=1", "modules.vision.parallel.sp=1"
        ),
        10,
    )


def test_p2p_bridge_vision_tp2_llm_tp2() -> None:
    # handoff=p2p over gloo (the NCCL path on GPUs): rows go vision unit leader -> LLM leader once and
    # are broadcast in the LLM TP group; their grads come back and are broadcast in the vision TP group
    _passed(
        verify(
            "steps=3",
            "handoff=p2p",
            "placement=disaggregated",
            "modules.vision.parallel.sp=1",
            "modules.vision.parallel.tp=2",
        ),
        3,
    )


def test_llm_dp2_sums_over_replicas() -> None:
    # the reference sees the union of both replicas' micro-batches, normalised by the global T
    _passed(verify("steps=3", "modules.llm.parallel.tp=1", "modules.llm.parallel.dp=2"), 3)


def test_verify_fails_beyond_tolerance() -> None:
    proc = verify("steps=1", "--grad-atol", "1e-12")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    assert "FAIL" in proc.stdout


def test_frozen_vision() -> None:
    # no grads and no optimizer state for the encoder on either side; the LLM still trains
    _passed(verify("steps=2", "modules.vision.freeze=true"), 2)
