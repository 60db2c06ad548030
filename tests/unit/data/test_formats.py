"""Every source format maps the demo set to the same samples, and names its bad record by location."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from formats_build import BUILDERS, DEMO

from dhp.config.schema import DataConfig, DatasetEntry
from dhp.data import bad
from dhp.data.check import check_data
from dhp.data.formats import detect_format
from dhp.data.source import build_source

pytestmark = pytest.mark.unit
EXPECTED_BAD = {
    "messages": bad.PLACEHOLDER_MISMATCH,
    "parts": bad.UNSUPPORTED_MODALITY,
    "parquet": bad.CORRUPT_IMAGE,
    "webdataset": bad.MALFORMED_RECORD,
}


def _data(entry: DatasetEntry, **kw) -> DataConfig:
    return replace(DataConfig(kind="llava", datasets=[entry]), **kw)


def _check(tiny_model, entry):
    return check_data(data=_data(entry), model=tiny_model, patch_seq_len=4096, token_seq_len=2048)


@pytest.mark.parametrize("fmt", sorted(BUILDERS))
def test_good_set_passes_and_bad_record_is_named(tiny_model, tmp_path, fmt):
    (tmp_path / "good").mkdir()
    entry, _ = BUILDERS[fmt](tmp_path / "good", bad=False)
    report = _check(tiny_model, entry)
    assert (report.num_records, report.num_good, report.num_bad) == (25, 25, 0)
    assert report.images_per_sample == {"0": 3, "1": 18, "2": 3, "3": 1}
    (tmp_path / "bad").mkdir()
    entry, loc = BUILDERS[fmt](tmp_path / "bad")
    report = _check(tiny_model, entry)
    assert report.num_good == 24 and report.failed
    assert list(report.bad_counts) == [EXPECTED_BAD[fmt]]
    assert report.bad_examples[EXPECTED_BAD[fmt]][0].startswith(f"{loc}: ")


def test_every_format_gives_the_same_samples(tiny_model, tmp_path):
    """Token ids, labels, types and pixels of each format equal the LLaVA demo's (same record order)."""
    ref_entry = DatasetEntry(name="demo", path=str(DEMO / "captions.json"), image_root=str(DEMO / "images"))
    ref, _, _ = build_source(
        data=_data(ref_entry), model=tiny_model, patch_seq_len=4096, token_seq_len=2048, seed=0
    )
    for fmt, build in BUILDERS.items():
        root = tmp_path / fmt
        root.mkdir()
        entry, _ = build(root, bad=False)
        src, _, _ = build_source(
            data=_data(entry), model=tiny_model, patch_seq_len=4096, token_seq_len=2048, seed=0
        )
        for i in (0, 7, 17):  # single-image captions; 17 is the last of captions.json
            a, b = ref.load(i), src.load(i)
            for field in ("input_ids", "labels", "mm_token_type_ids", "pixel_values", "image_grid_thw"):
                assert torch.equal(getattr(a, field), getattr(b, field)), (fmt, i, field)


def test_format_detection_and_override(tmp_path):
    for fmt, expected in (("messages", "llava"), ("parquet", "parquet"), ("webdataset", "webdataset")):
        root = tmp_path / fmt
        root.mkdir()
        entry, _ = BUILDERS[fmt](root, bad=False)
        assert detect_format(entry) == expected  # llava = JSON/JSONL, records told apart by keys
    assert detect_format(DatasetEntry(name="d", path=str(tmp_path / "parquet"))) == "parquet"
    assert detect_format(DatasetEntry(name="d", path=str(tmp_path / "webdataset"))) == "webdataset"
