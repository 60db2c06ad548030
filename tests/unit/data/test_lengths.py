"""The step-time estimate of a real-data run times the data's measured lengths (dhp.data.lengths):
the same counts ``dhp data check`` reports, a micro-batch's LLM rows padded to its expected longest
sample, the encoder on the rows' mean patches; memory keeps the seq_len bound. Data that cannot be
read stops the start-up checks (``dhp plan`` and ``dhp train`` alike) with its reason; a plan
compiled from a config whose lengths were never measured fills micro-batches to seq_len and says so."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
from conftest import DEMO, jsonl_data
from typer.testing import CliRunner

from dhp.cli import app
from dhp.data.check import check_data
from dhp.data.lengths import cached_lengths, sample_indices
from dhp.errors import ConfigError
from dhp.plan import compile_plan
from dhp.plan.compile import module_layouts, module_shapes
from dhp.plan.estimate import timing_shapes, vision_patches_per_replica
from dhp.runtime.launch.preflight import checked_config
from dhp.validation import load_config

ROWS = [  # three rows of clearly different lengths: text only, one photo, two photos and more text
    {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]},
    {
        "image": "cat.jpg",
        "conversations": [
            {"from": "human", "value": "<image>\nWhat animal is this?"},
            {"from": "gpt", "value": "A tabby cat lying down, looking to its left."},
        ],
    },
    {
        "image": ["espresso.jpg", "rocket.jpg"],
        "conversations": [
            {"from": "human", "value": "<image>\n<image>\nDescribe both pictures in detail, one by one."},
            {"from": "gpt", "value": "The first is a cup of coffee on a saucer. " * 6},
        ],
    },
]


def _write_rows(tmp_path, rows=ROWS):
    for name in ("cat.jpg", "espresso.jpg", "rocket.jpg"):
        shutil.copy(DEMO / "images" / name, tmp_path / name)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _overrides(tiny_model, path) -> list[str]:
    return [f"model.path={tiny_model.path}", f"data.path={path}"]


def _config(tiny_model, path):
    return load_config("tiny_vlm", _overrides(tiny_model, path))


def test_the_estimate_times_the_measured_lengths(tiny_model, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DHP_CACHE_DIR", str(tmp_path / "cache"))
    path = _write_rows(tmp_path)
    cfg = _config(tiny_model, path)
    said: list[str] = []
    measured = checked_config("tiny_vlm", _overrides(tiny_model, path), say=said.append)
    lengths = measured.data.lengths
    assert said == [] and lengths.rows == 3 and lengths.of_rows == 3 and lengths.media == 3
    assert (lengths.videos, lengths.video_frames) == (0, 0)
    # the counts dhp data check reports for the same rows (3 rows: p0, p50, p100 are all of them)
    report = check_data(
        data=jsonl_data(path, tmp_path, max_pixels=cfg.data.max_pixels),
        model=tiny_model,
        patch_seq_len=cfg.modules.vision.seq_len,
        token_seq_len=cfg.modules.llm.seq_len,
    )
    pct = report.tokens_percentiles
    assert list(lengths.tokens) == [pct["p0"], pct["p50"], pct["p100"]]
    assert sum(lengths.patches) == report.total_patches and min(lengths.patches) == 0
    a, b, c = lengths.tokens
    assert a < b < c < cfg.modules.llm.seq_len

    # micro-batch of 2 rows of 3: the longest is b in 1 of the 3 pairs and c in 2 of them
    mb = cfg.train.micro_batch_size
    assert mb == 2
    filled, timed = module_shapes(measured), timing_shapes(measured, module_shapes(measured))
    assert filled["llm"].seq_len == cfg.modules.llm.seq_len  # memory's shapes: the seq_len bound
    assert timed["llm"].micro_batch == mb and timed["llm"].seq_len == math.ceil((b + 2 * c) / 3)
    assert timed["llm"].tokens == mb * math.ceil((b + 2 * c) / 3)
    assert timed["vision"].image_patches == round(sum(lengths.patches) / 3)  # 3 photos
    reps = {m: lay.num_replicas for m, lay in module_layouts(cfg).items()}
    patches = vision_patches_per_replica(
        measured,
        seq_len=cfg.modules.vision.seq_len,
        micro_batch=mb,
        llm_replicas=reps["llm"],
        vision_replicas=reps["vision"],
    )
    assert patches == mb * sum(lengths.patches) / 3 * reps["llm"] / reps["vision"]

    plan, unmeasured = compile_plan(measured), compile_plan(cfg)
    line = plan.estimate["provenance"]
    assert f"median {b} tokens" in line and "3 rows sampled of 3" in line, line
    assert f"LLM {mb} x {math.ceil((b + 2 * c) / 3)} tokens" in line and "memory at the seq_len bound" in line
    assert plan.estimate["step_time_s"] < unmeasured.estimate["step_time_s"]
    assert "filled to seq_len (data lengths: not measured)" in unmeasured.estimate["provenance"]
    # memory never reads the sample: the same per-device peak either way
    assert [d.total for d in plan.devices] == [d.total for d in unmeasured.devices]


def test_lengths_are_cached_by_path_and_mtime(tiny_model, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DHP_CACHE_DIR", str(tmp_path / "cache"))
    path = _write_rows(tmp_path)
    data = jsonl_data(path, tmp_path, max_pixels=12544)
    args = dict(data=data, model=tiny_model, patch_seq_len=256, token_seq_len=256)
    first = cached_lengths(**args)
    for name in ("cat.jpg", "espresso.jpg", "rocket.jpg"):  # the rows can no longer be processed
        (tmp_path / name).unlink()
    assert cached_lengths(**args) == first  # the dataset file did not change: the cached counts
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = cached_lengths(**args)  # measured again: only the text-only row is left
    assert second.rows == 1 and list(second.tokens) == [first.tokens[0]]


def test_unreadable_data_stops_the_start_up_checks_and_the_plan(tiny_model, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DHP_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "broken.json"
    path.write_text("[{not json\n")
    with pytest.raises(ConfigError) as info:
        checked_config("tiny_vlm", _overrides(tiny_model, path), say=pytest.fail)
    assert "broken.json" in str(info.value)
    # the CLI's plan stops on it (the entry point prints it and exits 2; dhp train stops on the same)
    args = ["plan", "conf=tiny_vlm", f"model.path={tiny_model.path}", f"data.path={path}", "--dry-run"]
    res = CliRunner().invoke(app, args)
    assert isinstance(res.exception, ConfigError) and "broken.json" in str(res.exception)
    # a config whose lengths were never measured (the library's compile_plan): filled to seq_len, said
    line = compile_plan(_config(tiny_model, path)).estimate["provenance"]
    assert "micro-batches filled to seq_len (data lengths: not measured)" in line


def test_synthetic_data_is_left_as_configured() -> None:
    cfg = checked_config("tiny_vlm", [], say=pytest.fail)
    assert cfg.data.lengths.rows == 0 and cfg.data.kind == "synthetic"
    assert "data's lengths" not in compile_plan(cfg).estimate["provenance"]


def test_the_sample_is_bounded_spread_and_deterministic() -> None:
    picks, total = sample_indices([100, 10], [1.0, 2.0], seed=0, rows=8)
    assert total == 120 and len(picks) == 8
    assert picks == sample_indices([100, 10], [1.0, 2.0], seed=0, rows=8)[0]
    assert picks[0] == 0 and picks[-1] >= 100  # both datasets are in the sample
    assert sample_indices([5], [1.0], seed=0, rows=8) == ([0, 1, 2, 3, 4], 5)
