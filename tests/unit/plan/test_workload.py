"""The plan says what workload its numbers are for (``Plan.workload``, ``dhp plan --json``'s ``workload``):
the batch, the per-sample media and lengths (synthetic config or the sampled rows), each module's
bound and timed micro-batch, the tokens per step. A text-only sample, or a whole text-only dataset,
plans without dividing by its zero images or patches."""

from __future__ import annotations

import math

import pytest

from dhp.config.schema import DataLengths
from dhp.data.lengths import with_lengths
from dhp.plan import compile_plan
from dhp.plan.compile import module_shapes
from dhp.plan.memory import sp_rank_tokens
from dhp.plan.render import workload_table
from dhp.validation import load_config

pytestmark = pytest.mark.unit


def test_synthetic_workload_of_tiny_vlm() -> None:
    plan = compile_plan(load_config("tiny_vlm", []))
    w = plan.workload
    assert w["source"] == "synthetic"
    assert w["batch"] == {"micro_batch_size": 2, "global_batch_size": 4, "micro_batches_per_step": 2}
    # one 64-patch image (16 merged tokens + 2 markers) and 32 text tokens per sample
    s = w["per_sample"]
    assert (s["images"], s["videos"], s["video_frames"], s["audio"]) == (1, 0, 0, 0)
    assert (s["llm_tokens"], s["llm_tokens_max"], s["vision_patches"], s["vision_patches_max"]) == (
        50,
        50,
        64,
        64,
    )
    vision, llm = w["modules"]["vision"], w["modules"]["llm"]
    assert vision == {
        "seq_len": 256,
        "replicas": 1,
        "sp": 2,
        "patches_per_micro_batch": 128.0,  # 2 samples x 64 patches
        "patches_per_rank": 64.0,  # halved by SP=2
    }
    # synthetic micro-batches are timed at the LLM's bound (the estimate's own choice), said as such
    assert llm == {
        "seq_len": 256,
        "replicas": 1,
        "rows_per_micro_batch": 2,
        "tokens_per_row": 256,
        "tokens_per_micro_batch": 512,
    }
    t = w["tokens_per_step"]
    assert t == {"text": 200.0, "vision": 256.0, "llm_padded": 1024}
    est = plan.estimate  # the patches the estimate's throughput counts are the workload's
    assert math.isclose(est["vision_tokens_per_s"] * est["step_time_s"], t["vision"], rel_tol=1e-9)
    assert plan.to_json()["workload"] == w


def test_synthetic_video_counts_frames_and_temporal_patches() -> None:
    w = compile_plan(load_config("tiny_vlm_video", [])).workload
    s = w["per_sample"]
    assert (s["images"], s["videos"], s["video_frames"]) == (1, 1, 4)
    assert s["vision_patches"] == 64 + 2 * 64  # the image, and 4 frames = 2 temporal patches of 64
    assert w["modules"]["vision"]["patches_per_micro_batch"] == 2 * 192


def _measured(lengths: DataLengths, *overrides: str):
    cfg = load_config("tiny_vlm", ["data.path=rows.jsonl", *overrides])  # nothing read: lengths given
    return with_lengths(cfg, lengths)


def test_measured_rows_give_the_per_sample_counts_and_the_timed_micro_batch() -> None:
    lengths = DataLengths(
        rows=4,
        of_rows=40,
        tokens=[40, 60, 80, 100],
        patches=[0, 64, 64, 128],
        media=4,  # 3 photos and a video of 4 frames
        videos=1,
        video_frames=4,
    )
    plan = compile_plan(_measured(lengths))
    w = plan.workload
    assert w["source"] == "4 rows sampled of 40"
    s = w["per_sample"]
    assert (s["images"], s["videos"], s["video_frames"], s["audio"]) == (0.75, 0.25, 1.0, 0)
    assert (s["llm_tokens"], s["llm_tokens_max"], s["vision_patches"], s["vision_patches_max"]) == (
        70,
        100,
        64,
        128,
    )
    llm = w["modules"]["llm"]
    # 2 rows padded to the expected longest of 2 of the 4 rows: (60*1 + 80*2 + 100*3) / 6 = 86.67 -> 87
    assert (llm["rows_per_micro_batch"], llm["tokens_per_row"], llm["seq_len"]) == (2, 87, 256)
    assert w["modules"]["vision"]["patches_per_micro_batch"] == 2 * 64
    assert w["tokens_per_step"] == {"text": 280.0, "vision": 256.0, "llm_padded": 2 * 2 * 87}
    table = workload_table(plan)
    assert table is not None and "4 rows sampled of 40" in str(table.title)
    assert "0.75 images" in str(table.caption) and "280 LLM tokens" in str(table.caption)


def test_a_text_only_dataset_plans_with_no_patches() -> None:
    """Text-only rows (0 images, 0 patches): no division by the images or patches they lack."""
    lengths = DataLengths(rows=3, of_rows=3, tokens=[30, 40, 50], patches=[0, 0, 0], media=0)
    plan = compile_plan(_measured(lengths))
    vision = plan.workload["modules"]["vision"]
    assert vision["patches_per_micro_batch"] == 0 and vision["patches_per_rank"] == 0
    est = plan.estimate
    assert est["vision_tokens_per_s"] == 0 and math.isfinite(est["step_time_s"]) and est["step_time_s"] > 0
    assert plan.workload["tokens_per_step"]["vision"] == 0
    # disaggregated too (the encoder on its own GPU, its SP degree 1)
    alone = compile_plan(
        _measured(lengths, "placement=disaggregated", "modules.vision.gpus=1", "modules.vision.parallel.sp=1")
    )
    assert alone.workload["modules"]["vision"]["patches_per_rank"] == 0 and alone.fits


def test_sp_rank_tokens_of_no_patches_is_zero() -> None:
    shape = module_shapes(load_config("tiny_vlm", []))["vision"]
    assert sp_rank_tokens(shape.arch, 0, 2, 0) == 0.0  # no image to size a window by: was 0 / 0
    assert sp_rank_tokens(shape.arch, 0.0, 2, 64) == 0.0
    assert sp_rank_tokens(shape.arch, 128, 2, 64) == 64.0
