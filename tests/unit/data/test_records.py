"""LLaVA record validation: every malformed-record case raises a BadSampleError with file, line, reason."""

from __future__ import annotations

import json
import re

import pytest

from dhp.config.schema import DatasetEntry
from dhp.data import bad
from dhp.data.llava import LlavaDataset, resolve_path, validate_record
from dhp.errors import DataError

pytestmark = pytest.mark.unit

GOOD = {
    "id": "x",
    "image": "cat.jpg",
    "conversations": [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A cat."}],
}


def _dataset(tmp_path, records: list) -> LlavaDataset:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    (tmp_path / "img").mkdir(exist_ok=True)
    return LlavaDataset(DatasetEntry(name="t", path=str(path), image_root=str(tmp_path / "img")))


@pytest.mark.parametrize(
    ("record", "reason", "needle"),
    [
        ({**GOOD, "conversations": []}, bad.BAD_CONVERSATION, "no turns under messages/conversations"),
        (
            {**GOOD, "conversations": [{"from": "human", "value": "<image> hi"}]},
            bad.BAD_CONVERSATION,
            "alternate",
        ),
        (
            {**GOOD, "conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "<image>"}]},
            bad.BAD_CONVERSATION,
            "alternate",
        ),
        ({**GOOD, "conversations": [{"from": "bot", "value": "<image>"}]}, bad.BAD_CONVERSATION, "bot"),
        (
            {
                **GOOD,
                "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "  "}],
            },
            bad.BAD_CONVERSATION,
            "turn 1 has empty content",
        ),
        (
            {**GOOD, "conversations": [{"from": "human", "text": "<image>"}]},
            bad.BAD_CONVERSATION,
            "has no role/from and content/value",
        ),
        (
            {
                **GOOD,
                "conversations": [{"from": "human", "value": "<image><image>"}, GOOD["conversations"][1]],
            },
            bad.PLACEHOLDER_MISMATCH,
            "more <image> tags/parts than the 1 listed image(s)",
        ),
        ({"conversations": GOOD["conversations"]}, bad.PLACEHOLDER_MISMATCH, "than the 0 listed image"),
        (
            {
                **GOOD,
                "conversations": [{"from": "system", "value": "<image>"}, *GOOD["conversations"][1:]],
            },
            bad.PLACEHOLDER_MISMATCH,
            "the system turn holds media",
        ),
        ({**GOOD, "image": 7}, bad.MALFORMED_RECORD, "media = 7"),
        ([1, 2], bad.MALFORMED_RECORD, "not an object"),
        ("{not json", bad.MALFORMED_RECORD, "invalid JSON"),
        # the whole parse error: what, where and the text around it (not "Invalid control character at")
        (
            '{"a": "x\ty"}',
            bad.MALFORMED_RECORD,
            "Invalid control character at: line 1 column 9 (char 8), near",
        ),
    ],
)
def test_bad_record_names_file_line_and_reason(tmp_path, record, reason, needle):
    ds = _dataset(tmp_path, [GOOD, record])
    ds.record(0)  # the good line is fine
    with pytest.raises(bad.BadSampleError) as info:
        ds.record(1)
    err = info.value
    assert err.reason == reason
    assert err.location == f"{tmp_path / 'd.jsonl'}:2"  # 1-based line of the JSONL file
    assert needle in str(err)
    assert "Fix:" in str(err) and "on_bad_sample=skip" in str(err)


def test_multi_image_and_text_only_records(tmp_path):
    multi = {
        "image": ["a.jpg", "b.jpg"],
        "conversations": [
            {"from": "human", "value": "<image> and <image>?"},
            {"from": "gpt", "value": "Two."},
        ],
    }
    text = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello."},
        ]
    }
    ds = _dataset(tmp_path, [multi, text])
    r0, r1 = ds.record(0), ds.record(1)
    assert [p.name for p in r0.images] == ["a.jpg", "b.jpg"]
    assert r0.images[0].parent == tmp_path / "img"
    assert r1.images == () and [t for t, _ in r1.turns] == ["system", "user", "assistant"]


def test_json_record_location_is_the_record_index(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([GOOD, {**GOOD, "conversations": [{"from": "bot", "value": "x"}]}]))
    ds = LlavaDataset(DatasetEntry(name="t", path=str(path), image_root=str(tmp_path)))
    with pytest.raises(bad.BadSampleError, match=rf"{re.escape(str(path))}\[1\] \(bad_conversation\)"):
        ds.record(1)


def test_dataset_level_errors_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        LlavaDataset(DatasetEntry(name="t", path=str(tmp_path / "nope.json"), image_root=str(tmp_path)))
    (tmp_path / "d.json").write_text("[{")
    with pytest.raises(
        DataError,
        match=r"is not valid JSON \(Expecting property name enclosed in double quotes: line 1 column 3 \(char 2\)",
    ):
        LlavaDataset(DatasetEntry(name="t", path=str(tmp_path / "d.json"), image_root=str(tmp_path)))
    with pytest.raises(DataError, match="is not a directory"):
        LlavaDataset(DatasetEntry(name="t", path=str(tmp_path / "d.json"), image_root=str(tmp_path / "x")))


def test_pkg_paths_resolve_inside_installed_packages():
    root = resolve_path("pkg://dhp.data_assets/demo/images", key="k")
    assert (root / "cat.jpg").is_file()
    with pytest.raises(DataError, match="not installed"):
        resolve_path("pkg://no_such_pkg_xyz/a", key="k")


def test_shipped_demo_set_is_complete():
    """>= 12 real photographs, each referenced and captioned; multi-image and text-only samples present."""
    root = resolve_path("pkg://dhp.data_assets/demo", key="demo")
    photos = sorted(p.name for p in (root / "images").glob("*.jpg"))
    captions = json.loads((root / "captions.json").read_text())
    mixed = [json.loads(line) for line in (root / "mixed.jsonl").read_text().splitlines()]
    single = {r["image"]: r["conversations"][-1]["value"] for r in captions if r["id"].startswith("caption-")}
    assert len(photos) >= 12 and sorted(single) == photos  # one written caption per photograph
    assert all(len(c.split()) >= 20 for c in single.values())  # real sentences, not labels
    image_lists = [r.get("image") for r in mixed]
    assert sum(isinstance(i, list) and len(i) >= 2 for i in image_lists) >= 3
    assert sum(i is None for i in image_lists) >= 3
    for name, records in (("captions.json", captions), ("mixed.jsonl", mixed)):
        for i, r in enumerate(records):
            validate_record(r, location=f"{name}:{i}", image_root=root / "images")


def test_untagged_media_go_first_as_ms_swift_puts_them(tmp_path):
    """Fewer tags than listed images: the missing tags are prepended to the first non-system turn."""
    rec = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Compare with <image>."},
            {"role": "assistant", "content": "Similar."},
        ],
        "images": ["a.jpg", "b.jpg", "c.jpg"],
    }
    r = _dataset(tmp_path, [rec]).record(0)
    assert r.turns[1] == ("user", "<image><image>Compare with <image>.")
    assert [p.name for p in r.images] == ["a.jpg", "b.jpg", "c.jpg"]
