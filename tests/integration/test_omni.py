"""Three module groups (audio encoder, vision encoder, LLM) through the real runtime: ``dhp verify`` of
the tiny Qwen2.5-Omni and Qwen3-Omni-MoE thinkers against the unsplit transformers thinkers, collocated,
disaggregated and with two groups sharing GPUs apart from the third,
with the audio encoder sequence-parallel, on synthetic audio and on real audio files (WAV, FLAC and
MP3 written here, resampled from 44.1 and 22.05 kHz) in the layouts LLaMA-Factory and ms-swift write,
and on real videos whose own audio track is used (``use_audio_in_video``: MP4s of photographs with a
44.1 kHz stereo AAC track, interleaved with the frames as Qwen2.5-Omni's processor lays them out).

Tolerances are verify's own: loss and grad norm within 1e-5 relative, every gradient and every
parameter after the update within 1e-4 absolute (fp32).
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from rich.console import Console

from dhp.runtime.verify.compare import render_report, verify_plan
from dhp.validation import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "data"))

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "dhp" / "data_assets" / "demo"


def _passed(conf: str, steps: int, *overrides: str) -> None:
    """``dhp verify conf=CONF steps=STEPS *overrides`` in this process: every step within tolerance."""
    report = verify_plan(load_config(conf, list(overrides)), steps=steps)
    console = Console(record=True, width=200, file=io.StringIO())
    render_report(report, console=console)
    assert report.passed and len(report.steps) == steps, console.export_text()


def _speechy(seconds: float, rate: int, seed: int) -> np.ndarray:
    """A voiced-looking clip: a few harmonics of a gliding pitch with a syllable envelope and noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * rate)) / rate
    pitch = 140 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 * (1 + np.sin(2 * np.pi * 3.0 * t)) ** 2
    return (0.2 * voice * envelope + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.fixture(scope="module")
def omni_data(tmp_path_factory) -> dict[str, Path]:
    """A LLaMA-Factory ShareGPT file (``audios`` + ``images`` columns, ``<audio>``/``<image>`` tags) and
    an ms-swift JSONL (``messages`` + ``audios``), each mixing audio-only, image + audio and text-only
    records; the clips are real WAV (44.1 kHz stereo), FLAC (22.05 kHz) and MP3 (16 kHz) files."""
    root = tmp_path_factory.mktemp("omni_data")
    (root / "audio").mkdir()
    clips = {
        "a.wav": (0.6, 44100, 2),
        "b.flac": (0.4, 22050, 1),
        "c.mp3": (0.5, 16000, 1),
    }
    for i, (name, (seconds, rate, channels)) in enumerate(clips.items()):
        wave = np.repeat(_speechy(seconds, rate, i)[:, None], channels, axis=1)
        sf.write(str(root / "audio" / name), wave, rate)
    images = sorted((DEMO / "images").iterdir())[:2]
    for im in images:
        shutil.copy(im, root / im.name)
    sharegpt = [
        {
            "conversations": [
                {"from": "human", "value": "<audio>What is said?"},
                {"from": "gpt", "value": "Someone hums a gliding tune."},
            ],
            "audios": ["audio/a.wav"],
        },
        {
            "conversations": [
                {"from": "human", "value": "<image><audio>Does the sound fit the picture?"},
                {"from": "gpt", "value": "It is a calm hum over a still scene."},
            ],
            "images": [images[0].name],
            "audios": ["audio/b.flac"],
        },
        {
            "conversations": [
                {"from": "human", "value": "Name a colour."},
                {"from": "gpt", "value": "Blue."},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": "<audio><image>Describe both."},
                {"from": "gpt", "value": "A short hum and a photograph."},
            ],
            "audios": ["audio/c.mp3"],
            "images": [images[1].name],
        },
    ]
    lf = root / "lf"
    lf.mkdir()
    (lf / "omni.json").write_text(json.dumps(sharegpt))
    (lf / "dataset_info.json").write_text(
        json.dumps(
            {
                "omni": {
                    "file_name": "omni.json",
                    "formatting": "sharegpt",
                    "columns": {"messages": "conversations", "images": "images", "audios": "audios"},
                }
            }
        )
    )
    for sub in ("audio",):
        shutil.copytree(root / sub, lf / sub)
    for im in images:
        shutil.copy(im, lf / im.name)
    swift = root / "swift.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": "<audio>Transcribe."},
                {"role": "assistant", "content": "A hum."},
            ],
            "audios": ["audio/c.mp3"],
        },
        {
            "messages": [
                {"role": "user", "content": "<image>What is here?<audio>"},
                {"role": "assistant", "content": "A photo and a hum."},
            ],
            "images": [images[0].name],
            "audios": ["audio/a.wav"],
        },
        {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]},
        {
            "messages": [
                {"role": "user", "content": "<audio>And this?"},
                {"role": "assistant", "content": "Another hum."},
            ],
            "audios": ["audio/b.flac"],
        },
    ]
    swift.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"lf": lf / "omni.json", "swift": swift}


# ---- synthetic audio + image samples ---------------------------------------------------------
def test_omni_disaggregated_audio1_vision_sp2_llm_tp2(ray_local) -> None:
    # three disjoint groups on 5 ranks: audio on 1, vision SP=2 on 2, LLM TP=2 on 2
    _passed(
        "tiny_qwen2_5_omni",
        1,
        "placement=disaggregated",
        "cluster.gpus_per_node=6",
        "modules.audio.gpus=1",
        "modules.audio.parallel.sp=1",
    )


def test_qwen3_omni_disaggregated_audio1_vision_sp2_llm_ep2(ray_local) -> None:
    # three disjoint groups on 5 ranks: audio on 1, vision SP=2 on 2, the MoE LLM dp=2 x ep=2 on 2
    _passed(
        "tiny_qwen3_omni",
        1,
        "placement=disaggregated",
        "cluster.gpus_per_node=6",
        "modules.audio.gpus=1",
        "modules.audio.parallel.sp=1",
    )


def test_qwen3_omni_audio_and_vision_share_gpus_apart_from_the_llm(ray_local) -> None:
    # a mixed placement: audio and vision share 2 ranks, the LLM has 2 of its own
    _passed("tiny_qwen3_omni", 1, "placement=audio+vision/llm")


# ---- real audio files in the layouts peers write --------------------------------------------
def test_omni_llamafactory_audios_verify(ray_local, omni_data) -> None:
    # the recipe's collocated plan (three groups on the same 2 ranks: each audio cut on its attention
    # chunks over the audio group's 2 SP ranks, the images over the vision group's 2 SP ranks, LLM
    # TP=2 with SP inside TP), two steps of the LLaMA-Factory file, which mixes audio-only,
    # image + audio and text-only records in each step
    _passed(
        "tiny_qwen2_5_omni",
        2,
        f"data.path={omni_data['lf']}",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "modules.audio.seq_len=512",
        "modules.llm.seq_len=512",
        "data.max_pixels=12544",
    )


def test_omni_swift_audios_verify_disaggregated(ray_local, omni_data) -> None:
    _passed(
        "tiny_qwen2_5_omni",
        1,
        f"data.path={omni_data['swift']}",
        "placement=disaggregated",
        "cluster.gpus_per_node=6",
        "modules.audio.gpus=1",
        "modules.audio.parallel.sp=1",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "modules.audio.seq_len=512",
        "modules.llm.seq_len=512",
        "data.max_pixels=12544",
    )


@pytest.fixture(scope="module")
def video_audio_data(tmp_path_factory) -> Path:
    """A LLaMA-Factory ShareGPT file (``videos`` + ``audios`` columns) whose records set
    ``use_audio_in_video``: a video with its own sound, and an audio file before another such video.
    The videos are MP4s of demo photographs with a stereo 44.1 kHz AAC chirp (PyAV)."""
    pytest.importorskip("av", reason="PyAV (dhp[video]) decodes the videos and their audio tracks")
    from audio_build import write_photo_mp4

    root = tmp_path_factory.mktemp("video_audio")
    photos = sorted((DEMO / "images").glob("*.jpg"))
    write_photo_mp4(root / "a.mp4", photos[:3], seconds=3.0)
    write_photo_mp4(root / "b.mp4", photos[3:5], seconds=2.0)
    sf.write(str(root / "note.wav"), _speechy(0.5, 22050, 7), 22050)
    rows = [
        {
            "conversations": [
                {"from": "human", "value": "<video>What do you see and hear?"},
                {"from": "gpt", "value": "Three photographs over a rising tone."},
            ],
            "videos": ["a.mp4"],
            "use_audio_in_video": True,
        },
        {
            "conversations": [
                {"from": "human", "value": "<audio>Is this hum in the clip? <video>"},
                {"from": "gpt", "value": "No, the clip has a rising tone."},
            ],
            "audios": ["note.wav"],
            "videos": ["b.mp4"],
            "use_audio_in_video": True,
        },
    ]
    (root / "av.json").write_text(json.dumps(rows))
    return root / "av.json"


def test_omni_llamafactory_video_with_its_audio_verify(ray_local, video_audio_data) -> None:
    # each video's own audio track interleaved with its frames per 2-s chunk; the reference thinker
    # gets use_audio_in_video read from the tokens; audio SP=2 cuts the tracks like any audio. With the
    # reference's flag forced off, this step fails (grad-norm rel diff 3e-4): the layout is observed.
    from dhp.config.schema import DatasetEntry
    from dhp.data.formats import open_dataset

    records = open_dataset(DatasetEntry(name="av", path=str(video_audio_data)), allow_outside_root=False)
    assert [records.record(i).use_audio_in_video for i in range(len(records))] == [True, True]
    _passed(
        "tiny_qwen2_5_omni",
        1,
        f"data.path={video_audio_data}",
        "train.global_batch_size=2",
        "train.micro_batch_size=2",
        "modules.audio.seq_len=1024",
        "modules.llm.seq_len=512",
        "data.max_pixels=12544",
    )


def test_qwen3_omni_llamafactory_video_with_its_audio_verify(ray_local, video_audio_data) -> None:
    # Qwen3-Omni-MoE, the recipe's collocated plan: audio cut on whole attention windows over 2 SP
    # ranks, DeepStack edges from the vision group, the MoE LLM at dp=2 x ep=2 (one sample per
    # micro-batch) with the router's load-balancing loss over the step; each video's tokens placed
    # among its track's audio tokens by start time. With the reference's flag forced off, this
    # step fails (grad-norm rel diff 4e-2).
    _passed(
        "tiny_qwen3_omni",
        1,
        f"data.path={video_audio_data}",
        "train.global_batch_size=2",
        "train.micro_batch_size=1",
        "modules.audio.seq_len=1024",
        "modules.llm.seq_len=512",
        "data.max_pixels=12544",
    )
