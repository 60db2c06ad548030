"""`dhp.runtime.loop.train` end to end on a real local Ray with gloo worlds and the tiny Qwen2.5-VL: the
run directory and metrics, a non-finite step, skipped bad samples, and an FSDP vision replica
without images. Each plan's numbers against the unsplit model (loss, every gradient and every
parameter after the update) are checked by tests/integration/test_verify.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from plans import ALL_ONE

from dhp.errors import RuntimeFailure
from dhp.metrics import METRIC_KEYS
from dhp.runtime.loop.train import train
from dhp.validation import load_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 3


def _run(tmp_path, name, *overrides):
    cfg = load_config(
        "tiny_vlm", [f"name={name}", f"train.output_dir={tmp_path}", f"train.steps={STEPS}", *overrides]
    )
    result = train(cfg)
    (run_dir,) = (tmp_path / name).iterdir()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return result, run_dir, rows


@pytest.fixture(scope="module")
def reference(ray_local, tmp_path_factory):
    """tiny_vlm with every degree 1 (one rank per module)."""
    return _run(tmp_path_factory.mktemp("runs"), "ones", *ALL_ONE)


def test_run_directory_and_fixed_metric_names(reference):
    result, run_dir, rows = reference
    assert {p.name for p in run_dir.iterdir()} >= {"config.yaml", "plan.json", "metrics.jsonl", "checkpoints"}
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    expected = set(METRIC_KEYS) | {f"{m}_{p}_s" for m in ("vision", "llm") for p in ("fwd", "bwd", "step")}
    for r in rows:
        assert set(r) == expected
        assert set(r["peak_mem_bytes"]) == {"vision/0", "llm/0"} and min(r["peak_mem_bytes"].values()) > 0
        assert r["tokens_per_s_vision"] > 0 and r["tokens_per_s_text"] > 0 and 0 < r["mfu"] < 1
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
    assert rows[0]["lr"] < rows[1]["lr"]  # warmup (train/tiny: warmup_steps=2)
    assert result.losses == {r["step"]: r["loss"] for r in rows}
    assert result.last_checkpoint is not None and (result.last_checkpoint / "meta.json").is_file()
    # the start-up breakdown: every phase from the process's start to the end of step 1, timed
    startup = json.loads((run_dir / "startup.json").read_text())
    phases = [p["phase"] for p in startup["phases"]]
    for want in ("Ray start", "actors start", "process groups", "build", "step 1"):
        assert any(p.startswith(want) for p in phases), phases
    assert all(p["seconds"] >= 0 for p in startup["phases"])
    assert startup["total_s"] >= rows[0]["step_s"]


def test_non_finite_loss_stops_before_the_update(ray_local, tmp_path):
    # lr=1e30: AdamW's first update (~lr * sign(g)) overflows the weights, so step 2's loss is not finite
    with pytest.raises(
        RuntimeFailure, match=r"step 2: non-finite (loss|grad norm) .*the update was not applied"
    ):
        _run(tmp_path, "nan", *ALL_ONE, "train.lr=1e30", "train.warmup_steps=0")


def _llava_jsonl(path: Path, records: list[tuple[str, str | None]]) -> Path:
    """A LLaVA JSONL file: ``(id, image file or None for a text-only sample)`` per record."""
    lines = []
    for rid, image in records:
        rec: dict = {
            "id": rid,
            "conversations": [
                {"from": "human", "value": ("<image>\n" if image else "") + "What is this?"},
                {"from": "gpt", "value": f"A photograph: {rid}."},
            ],
        }
        if image:
            rec["image"] = image
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny HF checkpoint (its tokenizer handles real photos)."""
    from dhp.models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny")


def _demo_images() -> Path:
    import dhp.data_assets

    return Path(dhp.data_assets.__file__).parent / "demo" / "images"


def test_skipped_bad_samples_reach_metrics(ray_local, tmp_path, tiny_dir):
    """data.on_bad_sample=skip: a record whose image is missing is skipped, counted by reason in
    metrics.jsonl (``bad_samples``), and the step still gets its full batch of good samples."""
    records = [("missing", "no_such_photo.jpg")] + [
        (name, f"{name}.jpg") for name in ("cat", "coins", "rocket", "espresso", "astronaut")
    ]
    data = _llava_jsonl(tmp_path / "bad.jsonl", records)
    cfg = load_config(
        "tiny_vlm_demo",
        [
            "name=bad",
            f"train.output_dir={tmp_path / 'runs'}",
            "train.steps=1",
            "train.warmup_steps=0",
            f"model.path={tiny_dir}",
            f"data.datasets=[{{name:bad,path:'{data}',image_root:'{_demo_images()}',weight:1.0}}]",
            "data.shuffle=false",
            "data.on_bad_sample=skip",
            *ALL_ONE,
        ],
    )
    train(cfg)
    (run_dir,) = (tmp_path / "runs" / "bad").iterdir()
    (row,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert row["bad_samples"] == {"missing_file": 1}
    assert math.isfinite(row["loss"])
    (skipped,) = [json.loads(x) for x in (run_dir / "bad_samples.jsonl").read_text().splitlines()]
    assert (skipped["step"], skipped["location"], skipped["reason"]) == (1, f"{data}:1", "missing_file")


def test_vision_fsdp_replica_without_images_matches(ray_local, tmp_path, tiny_dir):
    """Vision FSDP=2 over micro-batches holding one image each (the other sample is text-only):
    one vision replica gets no image, runs a blank one so FSDP's collectives match (otherwise its
    peer hangs), and adds exactly zero gradient: losses equal every-degree-1 within 1e-5."""
    records = [("cat", "cat.jpg"), ("chat1", None), ("coins", "coins.jpg"), ("chat2", None)]
    data = _llava_jsonl(tmp_path / "mixed.jsonl", records)
    common = [
        "train.steps=2",
        "train.warmup_steps=0",
        "train.step_timeout_s=120",  # a hang fails in 2 minutes, not 15
        f"model.path={tiny_dir}",
        f"data.datasets=[{{name:mixed,path:'{data}',image_root:'{_demo_images()}',weight:1.0}}]",
        "data.shuffle=false",
    ]
    losses = {}
    for name, plan in {
        "ones": ALL_ONE,
        "fsdp": [*ALL_ONE, "modules.vision.gpus=2", "modules.vision.parallel.fsdp=2"],
    }.items():
        cfg = load_config("tiny_vlm_demo", [f"name={name}", f"train.output_dir={tmp_path}", *common, *plan])
        losses[name] = train(cfg).losses
    assert losses["fsdp"] == pytest.approx(losses["ones"], rel=1e-5)
