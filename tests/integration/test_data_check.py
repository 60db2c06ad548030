"""`dhp data check` through the real CLI (a subprocess) on the shipped demo set and on a broken copy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
DEMO = Path(__file__).resolve().parents[2] / "dhp" / "data_assets" / "demo"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from dhp.models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def check(tiny_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """`dhp data check` on the tiny recipe with the demo data group at its full 448x448 photo size and
    seq_lens that fit it."""
    args = ["conf=tiny_vlm", "data=demo", f"model.path={tiny_dir}"]
    args += ["data.max_pixels=200704", "modules.vision.seq_len=4096", "modules.llm.seq_len=2048", *extra]
    cmd = [sys.executable, "-m", "dhp.cli", "data", "check", *args]
    env = {**os.environ, "COLUMNS": "400"}  # long tmp paths: keep rich from folding or eliding them
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def broken_copy(tmp_path: Path) -> tuple[Path, list[str]]:
    """A copy of the demo set with cat.jpg deleted and rocket.jpg cut to 8 KB; overrides pointing at it."""
    root = tmp_path / "demo"
    shutil.copytree(DEMO, root)
    (root / "images" / "cat.jpg").unlink()
    rocket = root / "images" / "rocket.jpg"
    rocket.write_bytes(rocket.read_bytes()[:8000])
    overrides = [
        f"data.datasets.0.path={root / 'captions.json'}",
        f"data.datasets.0.image_root={root / 'images'}",
        f"data.datasets.1.path={root / 'mixed.jsonl'}",
        f"data.datasets.1.image_root={root / 'images'}",
    ]
    return root, overrides


@pytest.mark.slow
def test_shipped_demo_passes_with_a_summary(tiny_dir):
    out = check(tiny_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "25 samples: 25 good, 0 bad" in text
    for needle in ("encoder patches per sample", "0 (text-only)", "257-1024", "p50", "p99"):
        assert needle in text, needle
    assert "images per sample: 0 image(s): 3, 1 image(s): 18, 2 image(s): 3, 3 image(s): 1" in text


@pytest.mark.slow
def test_deleted_and_truncated_images_are_named_and_fail(tiny_dir, tmp_path):
    root, overrides = broken_copy(tmp_path)
    out = check(tiny_dir, *overrides)
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout
    assert "20 good, 5 bad" in " ".join(text.split())
    assert "missing_file: 2" in text and "corrupt_image: 3" in text and "FAILED" in text
    assert f"{root / 'captions.json'}[2]: image {root / 'images' / 'cat.jpg'} does not exist" in text
    assert f"{root / 'mixed.jsonl'}:3: image {root / 'images' / 'rocket.jpg'} cannot be decoded" in text


@pytest.mark.slow
def test_json_report_and_skip_policy(tiny_dir, tmp_path):
    root, overrides = broken_copy(tmp_path)
    out = check(tiny_dir, *overrides, "data.on_bad_sample=skip", "--json")
    assert out.returncode == 0, out.stdout + out.stderr  # skip: the run would go on
    doc = json.loads(out.stdout)
    assert doc["num_records"] == 25 and doc["num_good"] == 20 and doc["failed"] is False
    assert doc["bad_counts"] == {"corrupt_image": 3, "missing_file": 2}
    assert doc["bad_examples"]["missing_file"][0].startswith(f"{root / 'captions.json'}[2]: image ")
    assert any(f"{root / 'mixed.jsonl'}:3" in e for e in doc["bad_examples"]["corrupt_image"])
    assert sum(doc["patch_histogram"].values()) == 20
    assert set(doc["text_tokens_percentiles"]) == {"p0", "p50", "p90", "p99", "p100"}


@pytest.mark.slow
def test_missing_dataset_file_is_a_short_error(tiny_dir, tmp_path):
    out = check(tiny_dir, f"data.datasets.0.path={tmp_path / 'nope.json'}")
    assert out.returncode == 2
    assert "DataError" in out.stderr and f"{tmp_path / 'nope.json'} does not exist" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_all_four_formats_through_the_cli(tiny_dir, tmp_path):
    """One `dhp data check` over a messages JSONL, a typed-parts JSON, a parquet export and WebDataset
    shards built from the demo photos: every bad record is named by its own kind of location."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "data"))
    from formats_build import BUILDERS

    entries, locs = [], []
    for fmt, build in BUILDERS.items():
        (tmp_path / fmt).mkdir()
        entry, loc = build(tmp_path / fmt)
        root = f",image_root:{entry.image_root}" if entry.image_root else ""
        entries.append(f"{{name:{fmt},path:'{entry.path}'{root}}}")
        locs.append(loc)
    out = check(tiny_dir, f"data.datasets=[{','.join(entries)}]")
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout
    assert "100 samples: 96 good, 4 bad" in " ".join(text.split())
    for reason in (
        "placeholder_mismatch: 1",
        "unsupported_modality: 1",
        "corrupt_image: 1",
        "malformed_record: 1",
    ):
        assert reason in text, reason
    for loc in locs:  # file:line, file[record], file[row], shard:key
        assert f"- {loc}: " in text, loc
