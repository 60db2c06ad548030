"""Audio records in the layouts peers write (LLaMA-Factory dataset_info + sharegpt/alpaca, ms-swift
JSONL, parquet), read into Records with their audio paths in tag order; and ``dhp data check`` without
a model counting audio files and seconds from the headers and naming each bad clip by location."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from audio_build import write_mp4, write_sine, write_tar
from rich.console import Console

from dhp.config.schema import DataConfig, DatasetEntry
from dhp.data import bad
from dhp.data.check import render_report
from dhp.data.check_records import check_records
from dhp.data.formats import open_dataset
from dhp.errors import ConfigError

pytestmark = pytest.mark.unit
TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}


def _turns(user: str, answer: str = "A person says hello.") -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def _records(entry: DatasetEntry) -> list:
    ds = open_dataset(entry, allow_outside_root=False)
    out = []
    for i in range(len(ds)):
        try:
            out.append(ds.record(i))
        except bad.BadSampleError as err:
            out.append(err)
    return out


def _write_info(root: Path, entries: dict) -> Path:
    info = root / "dataset_info.json"
    info.write_text(json.dumps(entries))
    return info


@pytest.fixture
def lf_root(tmp_path) -> Path:
    """A LLaMA-Factory data folder: dataset_info.json, a sharegpt and an alpaca file, clips under audios/."""
    (tmp_path / "audios").mkdir()
    for name in ("1.wav", "2.flac", "3.wav"):
        write_sine(tmp_path / "audios" / name, seconds=0.5)
    sharegpt = [
        {"messages": _turns("<audio>What does the speaker say?"), "audios": ["audios/1.wav"]},
        {  # two clips, tags in two turns: the paths follow the tags
            "messages": [
                *_turns("Compare <audio> with"),
                {"role": "user", "content": "this one: <audio>"},
                {"role": "assistant", "content": "The second is louder."},
            ],
            "audios": ["audios/2.flac", "audios/3.wav"],
        },
        {"messages": _turns("<audio>Who speaks?"), "audios": ["audios/1.wav", "audios/2.flac"]},  # 1 tag, 2
        {"messages": _turns("No tag here."), "audios": ["audios/1.wav"]},  # LLaMA-Factory refuses: 0 != 1
    ]
    (tmp_path / "mllm_audio_demo.json").write_text(json.dumps(sharegpt))
    alpaca = [
        {
            "instruction": "<audio>Transcribe the clip.",
            "input": "",
            "output": "hello",
            "audios": ["audios/3.wav"],
        }
    ]
    (tmp_path / "alpaca_audio.json").write_text(json.dumps(alpaca))
    _write_info(
        tmp_path,
        {
            "mllm_audio_demo": {
                "file_name": "mllm_audio_demo.json",
                "formatting": "sharegpt",
                "columns": {"messages": "messages", "audios": "audios"},
                "tags": TAGS,
            },
            "alpaca_audio": {
                "file_name": "alpaca_audio.json",
                "formatting": "alpaca",
                "columns": {
                    "prompt": "instruction",
                    "query": "input",
                    "response": "output",
                    "audios": "audios",
                },
            },
        },
    )
    return tmp_path


def test_llamafactory_sharegpt_audio_paths_follow_the_tags(lf_root):
    info = str(lf_root / "dataset_info.json")
    recs = _records(DatasetEntry(name="mllm_audio_demo", info=info))
    one, two, fewer, untagged = recs
    assert one.turns[0] == ("user", "<audio>What does the speaker say?")
    assert one.audios == (lf_root / "audios" / "1.wav",)  # relative to the dataset_info.json's folder
    assert two.audios == (lf_root / "audios" / "2.flac", lf_root / "audios" / "3.wav")
    assert [t for _, t in two.turns][::2] == ["Compare <audio> with", "this one: <audio>"]
    assert not one.use_audio_in_video and one.videos == () and one.images == ()
    for err in (fewer, untagged):  # LLaMA-Factory's rule: as many <audio> tags as audio paths
        assert isinstance(err, bad.BadSampleError) and err.reason == bad.PLACEHOLDER_MISMATCH
        assert "<audio>" in err.detail and err.location.endswith(("[2]", "[3]"))


def test_llamafactory_alpaca_audio_column(lf_root):
    (rec,) = _records(DatasetEntry(name="alpaca_audio", info=str(lf_root / "dataset_info.json")))
    assert rec.turns == (("user", "<audio>Transcribe the clip."), ("assistant", "hello"))
    assert rec.audios == (lf_root / "audios" / "3.wav",)


def test_swift_jsonl_audios_absolute_relative_and_typed_parts(tmp_path):
    clip = write_sine(tmp_path / "abs.wav")
    (tmp_path / "rel").mkdir()
    rel = write_sine(tmp_path / "rel" / "b.wav")
    rows = [
        {"messages": _turns("<audio>语音说了什么"), "audios": [str(clip)]},
        {
            "messages": [{"role": "system", "content": "You transcribe."}, *_turns("<audio><audio>Both?")],
            "audios": ["rel/b.wav", str(clip)],
        },
        {  # a typed part with its own path, then a bare part taking the next listed clip
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "audio", "audio": "rel/b.wav"},
                        {"type": "text", "text": "and"},
                        {"type": "audio"},
                    ],
                },
                {"role": "assistant", "content": "Two clips."},
            ],
            "audios": [str(clip)],
        },
        {"messages": _turns("<audio><audio>"), "audios": [str(clip)]},  # more tags than clips
        {"messages": _turns("<audio>"), "audios": "rel/b.wav", "id": 7},  # a single path, an extra key
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    one, two, parts, more, single = _records(DatasetEntry(name="swift", path=str(path)))
    assert one.audios == (clip,) and one.turns[0][1] == "<audio>语音说了什么"
    assert two.turns[0] == ("system", "You transcribe.") and two.audios == (rel, clip)
    assert parts.audios == (rel, clip) and parts.turns[0][1] == "<audio>and<audio>"
    assert more.reason == bad.PLACEHOLDER_MISMATCH and more.location == f"{path}:4"
    assert single.audios == (rel,) and single.ignored == ()


def test_audio_paths_follow_the_image_path_rules(tmp_path):
    (tmp_path / "data").mkdir()
    path = tmp_path / "data" / "escape.jsonl"
    rows = [
        {"messages": _turns("<audio>"), "audios": ["../outside.wav"]},
        {"messages": _turns("<audio>"), "audios": [3]},
        {
            "messages": [
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "UklGR"}}]},
                {"role": "assistant", "content": "x"},
            ]
        },
        {"messages": [{"role": "system", "content": "<audio>"}, *_turns("hi")], "audios": ["a.wav"]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reasons = [e.reason for e in _records(DatasetEntry(name="x", path=str(path)))]
    assert reasons == [
        bad.PATH_OUTSIDE_ROOT,
        bad.MALFORMED_RECORD,
        bad.MALFORMED_RECORD,
        bad.PLACEHOLDER_MISMATCH,
    ]


def test_use_audio_in_video_per_record_and_per_dataset(tmp_path):
    rows = [
        {"messages": _turns("<video>What happens?"), "videos": ["v.mp4"], "use_audio_in_video": True},
        {"messages": _turns("<video>What happens?"), "videos": ["v.mp4"]},
        {"messages": _turns("<video>What happens?"), "videos": ["v.mp4"], "use_audio_in_video": False},
        {"messages": _turns("<video>What happens?"), "videos": ["v.mp4"], "use_audio_in_video": "yes"},
    ]
    (tmp_path / "videos.json").write_text(json.dumps(rows))
    info = _write_info(
        tmp_path,
        {
            "plain": {"file_name": "videos.json", "tags": TAGS},
            "with_sound": {"file_name": "videos.json", "tags": TAGS, "use_audio_in_video": True},
            "wrong": {"file_name": "videos.json", "use_audio_in_video": "true"},
        },
    )
    plain = _records(DatasetEntry(name="plain", info=str(info)))
    assert [r.use_audio_in_video for r in plain[:3]] == [True, False, False]
    assert plain[3].reason == bad.MALFORMED_RECORD and "use_audio_in_video" in plain[3].detail
    sound = _records(DatasetEntry(name="with_sound", info=str(info)))
    assert [r.use_audio_in_video for r in sound[:3]] == [True, True, False]  # the record's own key wins
    assert sound[0].videos == (tmp_path / "v.mp4",) and sound[0].audios == () and sound[0].ignored == ()
    with pytest.raises(ConfigError, match="use_audio_in_video"):
        open_dataset(DatasetEntry(name="wrong", info=str(info)), allow_outside_root=False)

    # the run's data.use_audio_in_video: the default of an entry without the key and of a plain file;
    # an entry's and a record's own value still win
    def run(entry: DatasetEntry) -> list[bool]:
        ds = open_dataset(entry, allow_outside_root=False, audio_in_video=True)
        return [ds.record(i).use_audio_in_video for i in range(3)]

    assert run(DatasetEntry(name="plain", info=str(info))) == [True, True, False]
    assert run(DatasetEntry(name="file", path=str(tmp_path / "videos.json"), tags=TAGS)) == [
        True,
        True,
        False,
    ]
    entries = {"silent": {"file_name": "videos.json", "tags": TAGS, "use_audio_in_video": False}}
    assert run(DatasetEntry(name="silent", info=str(_write_info(tmp_path, entries)))) == [True, False, False]


def test_parquet_audio_column_paths_and_embedded_bytes(tmp_path):
    write_sine(tmp_path / "a.wav")
    rows = [
        {"messages": _turns("<audio>One?"), "audios": [{"bytes": None, "path": "a.wav"}]},
        {"messages": _turns("<audio>Two?"), "audios": [{"bytes": b"RIFF....", "path": "b.wav"}]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    one, two = _records(DatasetEntry(name="pq", path=str(tmp_path / "train.parquet")))
    assert one.audios == (tmp_path / "a.wav",)
    assert two.reason == bad.CORRUPT_AUDIO and "stored inside the table" in two.detail
    assert two.location == f"{tmp_path / 'train.parquet'}[1]"


def test_an_audio_member_of_a_webdataset_shard_is_refused_by_name(tmp_path):
    clip = write_sine(tmp_path / "clip.wav").read_bytes()
    rec = {"messages": _turns("<audio>What is said?"), "audios": ["wav"]}
    write_tar(tmp_path / "audio-0000.tar", {"000000.json": json.dumps(rec).encode(), "000000.wav": clip})
    (err,) = _records(DatasetEntry(name="wds", path=str(tmp_path / "audio-0000.tar")))
    assert err.reason == bad.CORRUPT_AUDIO and "stored inside the shard" in err.detail


def test_data_check_counts_audio_from_headers_and_names_bad_clips(tmp_path):
    good = write_sine(tmp_path / "good.wav", seconds=1.5, rate=44100, channels=2)
    flac = write_sine(tmp_path / "good.flac", seconds=0.5)
    long = write_sine(tmp_path / "long.wav", seconds=3.0)
    empty = tmp_path / "empty.wav"
    sf.write(str(empty), np.zeros((0, 1), np.float32), 16000)
    cut = tmp_path / "cut.wav"
    cut.write_bytes(good.read_bytes()[:30])
    rows = [
        {"messages": _turns("<audio><audio>"), "audios": [good.name, flac.name]},  # line 1: 2.0 s
        {"messages": _turns("<audio>"), "audios": [cut.name]},  # line 2: corrupt
        {"messages": _turns("<audio>"), "audios": [empty.name]},  # line 3: empty
        {"messages": _turns("<audio>"), "audios": [long.name]},  # line 4: too long (limit 2 s)
        {"messages": _turns("<audio>"), "audios": ["gone.wav"]},  # line 5: missing
        {"messages": _turns("No audio.")},  # line 6
    ]
    av = _maybe_av()
    if av is not None:  # a video whose own sound is used, and one without sound
        write_mp4(tmp_path / "talk.mp4", audio_codec="aac", seconds=1.0)
        write_mp4(tmp_path / "silent.mp4", audio_codec=None)
        rows.append({"messages": _turns("<video>"), "videos": ["talk.mp4"], "use_audio_in_video": True})
        rows.append({"messages": _turns("<video>"), "videos": ["silent.mp4"], "use_audio_in_video": True})
    path = tmp_path / "clips.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(kind="llava", datasets=[DatasetEntry(name="clips", path=str(path))])
    report = check_records(data, max_audio_seconds=2.0, audio_tokens=lambda s: math.ceil(s * 25))
    expected = {bad.CORRUPT_AUDIO: 1, bad.EMPTY_AUDIO: 1, bad.AUDIO_TOO_LONG: 1, bad.MISSING_FILE: 1}
    if av is not None:
        expected[bad.NO_AUDIO_TRACK] = 1
    assert report.bad_counts == expected
    for reason, line in (
        (bad.CORRUPT_AUDIO, 2),
        (bad.EMPTY_AUDIO, 3),
        (bad.AUDIO_TOO_LONG, 4),
        (bad.MISSING_FILE, 5),
    ):
        assert report.bad_examples[reason][0].startswith(f"{path}:{line}: "), report.bad_examples[reason]
    assert report.audio_files == 2 and report.audios_per_sample == {"0": 1 + (av is not None), "2": 1}
    tracks = 1 if av is not None else 0
    assert report.video_audio_tracks == tracks
    assert report.audio_seconds == pytest.approx(2.0 + tracks * 1.0, abs=0.05)
    assert report.audio_tokens == 38 + 13 + tracks * 25  # ceil(1.5*25) + ceil(0.5*25) (+ the track)
    assert check_records(data, max_audio_seconds=2.0).audio_tokens is None  # no family count: not shown
    console = Console(record=True, width=200)
    render_report(report, console=console)
    text = console.export_text()
    assert "audio files per sample: 0 audio(s)" in text and "LLM tokens" in text
    assert f"audio in all: 2 file(s) and {tracks} video audio track(s)" in text


def _maybe_av():
    try:
        import av  # optional (dhp[video]): the video rows need it
    except ImportError:
        return None
    return av if {"aac", "mpeg4"} <= set(av.codecs_available) else None
