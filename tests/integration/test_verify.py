"""``dhp verify`` on the tiny models: each plan against the unsplit transformers model.

The plans run through the real runtime on the module's shared local Ray (``ray_local``) with
``verify_plan``, the function behind ``dhp verify``; two tests go through the CLI (its PASS table and
exit 0 in this process, and exit 1 with FAIL beyond tolerance from the installed entry point in a
process of its own). The plans are grouped by placement (disaggregated on 4 and on 3 bundles,
collocated on 2 and on 4).

Tolerances are verify's own: loss and grad norm within 1e-5 relative, every gradient and every
parameter after the update within 1e-4 absolute (fp32). ``test_verify_fails_beyond_tolerance`` proves the comparison can fail: an
impossible gradient tolerance (1e-12; SP/TP reduce in another order, so fp32 rounding differs) must
exit 1.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_here import dhp_here, explain, words
from rich.console import Console

from dhp.runtime.verify.compare import render_report, verify_plan
from dhp.validation import load_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _passed(conf: str, steps: int, *overrides: str) -> None:
    """``dhp verify conf=CONF steps=STEPS *overrides`` in this process: every step within tolerance."""
    report = verify_plan(load_config(conf, list(overrides)), steps=steps)
    console = Console(record=True, width=200, file=io.StringIO())
    render_report(report, console=console)
    assert report.passed and len(report.steps) == steps, console.export_text()


def verify_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "dhp.cli", "verify", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


# ---- disaggregated on 4 ranks (2 + 2) --------------------------------------------------------
def test_disaggregated_sequence_parallel_selective_ac_mode_chunked(ray_local) -> None:
    # vision Ulysses SP=2 and LLM TP=2 + SP, both with op-level (selective) AC, on disjoint ranks
    # (the encoder runs micro-batch i+1's forward before i's recompute), and a 7-token loss chunk
    # that divides no micro-batch's label count
    _passed(
        "tiny_vlm",
        2,
        "placement=disaggregated",
        "modules.llm.parallel.sequence_parallel=true",
        "modules.llm.activation_checkpointing=selective",
        "modules.vision.activation_checkpointing=selective",
        "modules.llm.loss_chunk_tokens=7",
    )


def test_p2p_bridge_vision_tp2_llm_tp2(ray_local) -> None:
    # handoff=p2p over gloo (the NCCL path on GPUs): rows go vision unit leader -> LLM leader once and
    # are broadcast in the LLM TP group; their grads come back and are broadcast in the vision TP group
    _passed(
        "tiny_vlm",
        3,
        "handoff=p2p",
        "placement=disaggregated",
        "modules.vision.parallel.sp=1",
        "modules.vision.parallel.tp=2",
    )


# ---- disaggregated on 3 ranks ----------------------------------------------------------------
def test_disaggregated_vision1_llm_tp2(ray_local) -> None:
    _passed(
        "tiny_vlm", 10, "placement=disaggregated", "modules.vision.gpus=1", "modules.vision.parallel.sp=1"
    )


def test_p2p_two_vision_replicas_into_one_llm_rank(ray_local) -> None:
    # two encoder replicas (DP=2) feed one LLM rank over the gloo bridge, pipelined F0 F1 B0
    _passed(
        "tiny_vlm",
        2,
        "handoff=p2p",
        "placement=disaggregated",
        "modules.vision.parallel.sp=1",
        "modules.vision.parallel.dp=2",
        "modules.llm.gpus=1",
        "modules.llm.parallel.tp=1",
    )


def test_qwen3_vl_verify_disaggregated_two_vision_ranks_one_llm_rank(ray_local) -> None:
    # Qwen3-VL: 2 encoder ranks (SP=2) into one LLM rank, DeepStack edges included
    _passed("tiny_qwen3_vl", 2, "placement=disaggregated", "modules.llm.gpus=1", "modules.llm.parallel.tp=1")


def test_qwen3_vl_moe_verify_disaggregated_ep2(ray_local) -> None:
    # Qwen3-VL-MoE: vision SP=2 into LLM dp=2 with ep=2 (each LLM rank holds 4 of the 8 experts,
    # tokens exchanged by all-to-all); the router's load-balancing loss over both replicas' tokens is
    # in the loss and its gradient, as in the reference. (Collocated: `dhp verify conf=tiny_qwen3_vl_moe`.)
    _passed("tiny_qwen3_vl_moe", 1, "placement=disaggregated")


def test_moe_expert_tp_and_expert_fsdp_through_the_runtime(ray_local) -> None:
    # the experts' two axes beyond EP, from the tiny HF checkpoint through the workers: Qwen3.5-MoE
    # (shared expert, Gated DeltaNet TP) at tp=2 x etp=2 (each TP rank routes half the tokens to
    # its 4 of the 8 experts), disaggregated; Qwen3-VL-MoE at dp=2 with expert FSDP (each rank
    # keeps half of every expert tensor, gathered per layer), collocated
    _passed(
        "tiny_qwen3_5_moe",
        2,
        "placement=disaggregated",
        "modules.llm.parallel={dp: 1, fsdp: 1, sp: 1, tp: 2, ep: 1, etp: 2, zero: 0, sequence_parallel: false}",
    )
    _passed("tiny_qwen3_vl_moe", 2, "modules.llm.parallel.ep=1", "modules.llm.parallel.expert_fsdp=true")


def test_pipeline_interleaved_disaggregated(ray_local) -> None:
    # Qwen3.5 in 4 stages over 2 pipeline ranks (interleaved 1F1B, 2 stages each: layers 0 and 2 on
    # rank 0, 1 and 3 on rank 1, so Gated DeltaNet layers on both and the full-attention layer on the
    # last), the step's 4 micro-batches in one schedule, the encoder's rows sent to the first stage
    # only and their gradients back from it
    _passed(
        "tiny_qwen3_5", 3, "placement=disaggregated", "modules.vision.gpus=1", "modules.vision.parallel.sp=1",
        "modules.llm.gpus=2", "train.micro_batch_size=1", "train.global_batch_size=4",
        "modules.llm.parallel={dp: 1, fsdp: 1, sp: 1, tp: 1, zero: 0, sequence_parallel: false, pp: 2, "
        "pp_virtual: 2, pp_schedule: interleaved_1f1b}",
    )  # fmt: skip


def test_pipeline_composes_with_tp_and_with_ep(ray_local) -> None:
    # collocated on 4: pp=2 x tp=2 (1F1B; each stage's layers TP-sharded), Qwen3-VL-MoE at
    # pp=2 x dp=2 x ep=2 with the router's load-balancing loss (the sparse layers on the first stage,
    # whose share of the term rides on its output's backward; the dense layer alone on the second;
    # the step's routing sums from one pipelined statistics pass), and Qwen3.5
    # zero bubble x tp=2
    four = ["modules.vision.gpus=4", "modules.vision.parallel.dp=2", "modules.vision.parallel.sp=2",
            "modules.llm.gpus=4", "train.global_batch_size=8"]  # fmt: skip
    _passed("tiny_vlm", 3, *four, "train.micro_batch_size=2", "modules.llm.parallel.tp=2",
            "modules.llm.parallel.pp=2", "modules.llm.parallel.sequence_parallel=false")  # fmt: skip
    _passed("tiny_qwen3_vl_moe", 3, *four, "train.micro_batch_size=1",
            "modules.llm.parallel.pp=2", "modules.llm.parallel.dp=2", "modules.llm.parallel.ep=2",
            "modules.llm.parallel.tp=1")  # fmt: skip
    # zero bubble (each backward split into its input and weight passes) with TP and full AC
    _passed("tiny_qwen3_5", 2, *four, "train.micro_batch_size=2", "modules.llm.parallel.tp=2",
            "modules.llm.parallel.pp=2", "modules.llm.parallel.pp_virtual=2", "modules.llm.parallel.pp_schedule=zero_bubble",
            "modules.llm.parallel.sequence_parallel=false", "modules.llm.activation_checkpointing=full")  # fmt: skip


# ---- collocated on 2 bundles (vision rank i and LLM rank i share bundle i) --------------------
def test_llm_dp2_sums_over_replicas(ray_local) -> None:
    # the reference sees the union of both replicas' micro-batches, normalised by the global T
    _passed("tiny_vlm", 3, "modules.llm.parallel.tp=1", "modules.llm.parallel.dp=2")


def test_frozen_vision(ray_local) -> None:
    # no grads and no optimizer state for the encoder on either side; the LLM still trains
    _passed("tiny_vlm", 2, "modules.vision.freeze=true")


def test_qwen3_vl_verify_collocated_sp2_tp2(ray_local) -> None:
    # Vision Ulysses SP=2 sends each rank's rows of image_embeds and of both DeepStack features; the
    # LLM gets all 1 + K edges and sends every edge's gradient back. Measured max|dg| ~5e-7.
    _passed("tiny_qwen3_vl", 2)


def test_verify_video_packed_sp2_tp2(ray_local) -> None:
    # every sample: an image and a 4-frame video (0.5 s per temporal patch); with data.packing both
    # samples of a micro-batch share one LLM row, while the reference runs each sample alone with
    # pixel_values_videos / second_per_grid_ts. The one-process parities in tests/parity/test_video.py
    # and tests/parity/test_packing.py cover both features in the fast tier.
    _passed("tiny_vlm_video", 1, "data.packing=true", "data.max_tokens=512")


def test_verify_lora_recipe_at_its_own_lr(ray_local) -> None:
    # adapters only, vision SP=2 + LLM TP=2 with SP, lr 5e-3: AdamW turns rounding-level differences
    # of the near-zero A-matrix gradients into ~lr per element, so the parameter check compares the
    # update of the plan's own gradients (dhp.runtime.verify.compare), not two trajectories
    _passed("tiny_vlm_lora", 3)


def test_collocated_sp2_tp2_ten_steps_through_the_cli(ray_local) -> None:
    # the CLI command itself (argument parsing, the per-step rows, the PASS table, the exit code), run
    # in this process on the shared Ray; test_verify_fails_beyond_tolerance runs the installed entry
    # point in a process of its own. The recipe already turns sequence parallelism on inside the
    # LLM's TP group; say it explicitly
    result = dhp_here("verify", "conf=tiny_vlm", "steps=10", "modules.llm.parallel.sequence_parallel=true")
    assert result.exit_code == 0, explain(result)
    assert "PASS" in words(result) and "over 10 step(s)" in words(result), explain(result)


# ---- collocated on 4 bundles (4 + 4 ranks) ---------------------------------------------------
def test_collocated_vision_tp2_dp2_llm_tp2_fsdp2(ray_local) -> None:
    # 4 + 4 ranks: encoder TP x DP (unit 1 sends from rank 2, not 1), LLM TP x FSDP (2-D mesh)
    _passed(
        "tiny_vlm",
        2,
        "modules.vision.parallel.sp=1",
        "modules.vision.parallel.tp=2",
        "modules.vision.parallel.dp=2",
        "modules.vision.gpus=4",
        "modules.llm.parallel.tp=2",
        "modules.llm.parallel.fsdp=2",
        "modules.llm.gpus=4",
    )


# ---- the installed entry point, in a process of its own --------------------------------------
def test_verify_fails_beyond_tolerance() -> None:
    proc = verify_cli("conf=tiny_vlm", "steps=1", "--grad-atol", "1e-12")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    assert "FAIL" in proc.stdout
