"""Each layout users already have, through the real reader and processor: it checks clean and its
media land where the peer puts them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from layouts_build import (
    DEMO,
    PKG,
    shipped_entries,
    wds_captions,
    wds_extension,
    wds_llava_record,
    wds_turn_list,
)

from dhp.config.schema import DataConfig, DatasetEntry
from dhp.data import bad
from dhp.data.check import check_data
from dhp.data.dataset_info import resolve_info
from dhp.data.formats import open_dataset

pytestmark = pytest.mark.unit
VIDEO = {"video_fps": 4.0, "video_folder_fps": 4.0, "video_max_frames": 8}


def _check(model, *entries: DatasetEntry, **kw):
    data = replace(DataConfig(kind="llava", datasets=list(entries), **VIDEO), **kw)
    return check_data(data=data, model=model, patch_seq_len=8192, token_seq_len=4096)


def _records(entry: DatasetEntry):
    ds = open_dataset(entry, allow_outside_root=False)
    return [ds.record(i) for i in range(len(ds))]


def _media(rec) -> list[str]:
    return [getattr(p, "name", str(p)).rsplit("/", 1)[-1] for p in (*rec.images, *rec.videos)]


@pytest.mark.parametrize("layout", sorted(shipped_entries()))
def test_shipped_peer_file_checks_clean(tiny_model, layout):
    entry = shipped_entries()[layout]
    report = _check(tiny_model, entry)
    assert report.num_bad == 0, report.bad_examples
    assert report.num_good == report.num_records > 0


def test_llamafactory_mllm_demo_tags_take_the_images_in_order():
    recs = _records(shipped_entries()["llamafactory_mllm_demo"])
    first = recs[0]
    assert [r for r, _ in first.turns] == ["user", "assistant", "user", "assistant"]
    assert first.turns[2][1] == "What colour are its eyes?<image>"  # the tag stays where it was written
    assert _media(first) == ["cat.jpg", "cat.jpg"]
    # no tag (LLaMA-Factory's current mllm_demo.json): the image goes first in the first user turn
    assert recs[1].turns[0] == ("user", "<image>What is in the cup?") and _media(recs[1]) == ["espresso.jpg"]


def test_swift_untagged_images_go_first_and_pretraining_keeps_images_in_the_assistant_turn():
    recs = _records(shipped_entries()["swift"])
    assert recs[0].turns[0] == ("system", "You are a helpful assistant.")
    assert recs[1].turns[0] == ("user", "<image>What is shown here?")  # ms-swift: untagged -> front
    assert recs[2].videos and recs[2].turns[0][1].startswith("<video>")
    assert [r for r, _ in recs[3].turns] == ["assistant"]  # pre-training
    assert recs[3].turns[0][1].count("<image>") == 2 and _media(recs[3]) == ["brick_wall.jpg", "grass.jpg"]


def test_v1_typed_parts_keep_their_order():
    recs = _records(shipped_entries()["llamafactory_v1"])
    assert recs[0].turns[0] == ("user", "<image>How many coins can you count?")
    assert recs[1].turns[1] == ("user", "Compare the two views: <image><image>")
    assert _media(recs[1]) == ["motorcycle_left.jpg", "motorcycle_right.jpg"]


def test_sharegpt_system_column_becomes_the_system_turn():
    rec = _records(shipped_entries()["sharegpt"])[0]
    assert rec.turns[0] == ("system", "You describe photographs in one sentence.")
    assert rec.turns[1][0] == "user" and _media(rec) == ["moon_surface.jpg"]


def test_audio_records_are_refused_by_name_and_the_rest_loads(tiny_model, tmp_path):
    entry = DatasetEntry(name="mllm_audio_demo", info=f"{PKG}/dataset_info.json")
    mixed = tmp_path / "mixed.jsonl"
    rows = json.loads((DEMO / "mllm_audio_demo.json").read_text())
    rows += json.loads((DEMO / "mllm_demo.json").read_text())
    mixed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = _check(tiny_model, entry, DatasetEntry(name="m", path=str(mixed), image_root=str(DEMO)))
    assert report.bad_counts == {bad.UNSUPPORTED_MODALITY: 2}
    assert report.num_good == 3
    assert any("audio module" in e for e in report.bad_examples[bad.UNSUPPORTED_MODALITY])


@pytest.mark.parametrize("build", [wds_turn_list, wds_llava_record, wds_extension, wds_captions])
def test_webdataset_layouts_check_clean(tiny_model, tmp_path, build):
    entry = build(tmp_path)
    report = _check(tiny_model, entry)
    assert report.num_bad == 0, report.bad_examples
    assert report.num_good == report.num_records > 0
    assert all(len(r.images) == 1 for r in _records(entry))


def test_extra_keys_are_ignored_and_listed_once(tiny_model, tmp_path, caplog):
    rows = [
        dict(r, id=f"r{i}", score=0.5, meta={"src": "web"})
        for i, r in enumerate(json.loads((DEMO / "mllm_demo.json").read_text()))
    ]
    path = tmp_path / "extra.json"
    path.write_text(json.dumps(rows))
    with caplog.at_level("WARNING", logger="dhp.data"):
        report = _check(tiny_model, DatasetEntry(name="x", path=str(path), image_root=str(DEMO)))
    assert report.num_bad == 0 and report.ignored_keys == {"x": ["meta", "score"]}
    listed = [r.getMessage() for r in caplog.records if "ignoring record key" in r.getMessage()]
    assert len(listed) == 1 and "'meta', 'score'" in listed[0]


def test_columns_and_tags_map_a_dataset_of_its_own_names(tiny_model, tmp_path):
    """LLaMA-Factory's mapping, given per dataset: other column and role names."""
    rows = [
        {
            "dialog": [
                {"speaker": "asker", "text": "<image>What is this?"},
                {"speaker": "bot", "text": "A cat."},
            ],
            "pics": ["images/cat.jpg"],
            "sys": "Be brief.",
        }
    ]
    path = tmp_path / "own.json"
    path.write_text(json.dumps(rows))
    entry = DatasetEntry(
        name="own",
        path=str(path),
        media_dir=str(DEMO),
        formatting="sharegpt",
        columns={"messages": "dialog", "images": "pics", "system": "sys"},
        tags={"role_tag": "speaker", "content_tag": "text", "user_tag": "asker", "assistant_tag": "bot"},
    )
    (rec,) = _records(entry)
    assert [r for r, _ in rec.turns] == ["system", "user", "assistant"] and _media(rec) == ["cat.jpg"]
    assert _check(tiny_model, entry).num_bad == 0


def test_dataset_info_entry_is_read_from_the_file():
    entry = resolve_info(DatasetEntry(name="mllm_video_demo", info=f"{PKG}/dataset_info.json"))
    assert entry.path.endswith("mllm_video_demo.json") and entry.columns["videos"] == "videos"
    assert entry.tags["user_tag"] == "user" and entry.media_dir.endswith("demo")


def test_check_counts_videos_apart_from_images_and_text(tiny_model):
    report = _check(tiny_model, shipped_entries()["llamafactory_video"])
    assert report.images_per_sample == {"0": 2} and report.videos_per_sample == {"1": 2}
    assert report.video_tokens > 0 and report.image_tokens == 0 and report.text_tokens > 0
    # the text percentiles leave the video tokens out
    assert report.text_tokens_percentiles["p100"] < report.tokens_percentiles["p100"]


def test_show_decodes_roles_media_and_loss(tiny_model):
    data = DataConfig(kind="llava", datasets=[shipped_entries()["swift"]], shuffle=False, **VIDEO)
    report = check_data(data=data, model=tiny_model, patch_seq_len=8192, token_seq_len=4096, show=4)
    first, _, video, pretrain = report.shown
    assert "<|im_start|>user\n<|vision_start|><image 1: " in first and "<image 2: " in first
    body = first.split("\n", 1)[1]
    assert "[[The first is a portrait" in body and "[[" not in body.split("<|im_start|>assistant")[0]
    assert "<video 1: " in video and "1 video(s)" in video
    assert "<|im_start|>assistant\n[[<|vision_start|>]]<image 1: " in pretrain


def test_bare_file_check_needs_no_recipe(tmp_path):
    """`dhp data check data.path=FILE`: records, media and counts without a tokenizer."""
    from dhp.config.data_shortcuts import bare_data_config
    from dhp.data.check_records import check_records

    rows = json.loads((DEMO / "mllm_demo.json").read_text())
    for r in rows:  # absolute paths, as ms-swift's docs recommend
        r["images"] = [str(DEMO / p) for p in r["images"]]
    rows.append({"messages": rows[0]["messages"], "images": [str(DEMO / "images" / "nope.jpg")] * 2})
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(rows))
    report = check_records(bare_data_config([f"data.path={path}"]))
    assert (report.num_records, report.num_good) == (4, 3)
    assert report.images_per_sample == {"1": 2, "2": 1} and report.bad_counts == {bad.MISSING_FILE: 1}
    assert report.failed  # on_bad_sample=raise: a run would stop at line 4


def test_instruction_and_pair_records_as_ms_swift_and_llamafactory_read_them(tiny_model, tmp_path):
    """ms-swift's AutoPreprocessor formats beside messages (ShareGPT `conversation` pairs, alpaca,
    query-response with history) and LLaMA-Factory's alpaca formatting, with images."""
    img = str(DEMO / "images" / "coins.jpg")
    rows = [
        {
            "system": "Be brief.",
            "conversation": [{"human": "<image>What is this?", "assistant": "Coins."}],
            "images": [img],
        },
        {
            "instruction": "Describe the photo.",
            "input": "One sentence.",
            "output": "Silver coins in rows.",
            "images": [img],
        },
        {
            "query": "And now?",
            "response": "Still coins.",
            "history": [["<image>What is it?", "Coins."]],
            "images": [img],
        },
    ]
    path = tmp_path / "swift_formats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    entry = DatasetEntry(name="sf", path=str(path))
    pair, alpaca, qr = _records(entry)
    assert pair.turns == (("system", "Be brief."), ("user", "<image>What is this?"), ("assistant", "Coins."))
    assert alpaca.turns == (
        ("user", "<image>Describe the photo.\nOne sentence."),
        ("assistant", "Silver coins in rows."),
    )
    assert [r for r, _ in qr.turns] == ["user", "assistant", "user", "assistant"] and qr.turns[2] == (
        "user",
        "And now?",
    )
    assert _check(tiny_model, entry).num_bad == 0


def test_caption_shards_are_pre_training_records(tmp_path):
    """img2dataset's layout: the .txt caption (else the metadata's caption) is one assistant turn
    holding its image; the metadata keys are ignored and listed."""
    a, b = _records(wds_captions(tmp_path))
    assert a.turns == (("assistant", "<image>A close-up of a tabby cat with yellow-green eyes."),)
    assert b.turns == (("assistant", "<image>Loose grey gravel."),)
    assert "url" in a.ignored and "caption" not in b.ignored
