"""The check library: histogram, percentiles, bad samples by reason, policy verdict, workers."""

from __future__ import annotations

import pytest
from conftest import demo_data

from dhp.data.check import check_data, patch_histogram, percentiles

pytestmark = pytest.mark.unit


def test_histogram_and_percentiles_are_exact():
    hist = patch_histogram([0, 0, 256, 257, 1024, 4096, 70000])
    assert hist == {
        "0 (text-only)": 2,
        "1-256": 1,
        "257-1024": 2,
        "1025-4096": 1,
        "4097-16384": 0,
        "16385-65536": 0,
        ">65536": 1,
    }
    assert percentiles(list(range(1, 101))) == {"p0": 1, "p50": 50, "p90": 90, "p99": 99, "p100": 100}
    assert percentiles([]) == {}


def test_report_on_a_broken_copy_with_workers(tiny_model, demo_copy):
    (demo_copy / "images" / "gravel.jpg").unlink()  # used by captions[14] and mixed.jsonl:2
    data = demo_data(num_workers=2)
    data.datasets[0].path = str(demo_copy / "captions.json")
    data.datasets[0].image_root = data.datasets[1].image_root = str(demo_copy / "images")
    data.datasets[1].path = str(demo_copy / "mixed.jsonl")
    report = check_data(data=data, model=tiny_model, patch_seq_len=4096, token_seq_len=2048)
    assert (report.num_records, report.num_good, report.bad_counts) == (25, 23, {"missing_file": 2})
    assert report.bad_examples["missing_file"][0].startswith(f"{demo_copy / 'captions.json'}[14]: image ")
    assert report.failed and report.to_json()["num_bad"] == 2
    assert report.images_per_sample == {"0": 3, "1": 17, "2": 2, "3": 1}
    assert sum(report.patch_histogram.values()) == 23 and report.patch_histogram["0 (text-only)"] == 3
    skip = check_data(
        data=demo_data(on_bad_sample="skip"), model=tiny_model, patch_seq_len=1024, token_seq_len=2048
    )
    assert not skip.failed and skip.bad_counts == {"vision_too_long": 4}  # the multi-image samples
