"""A video's own audio track (``use_audio_in_video``) in the data layer, against transformers' processors.

The videos are real MP4s written here by PyAV: photographs from the demo set as frames, and a stereo
44.1 kHz AAC track (a chirp on one channel, a sine on the other). dhp's sample of a record is compared
with what ``Qwen2_5OmniProcessor`` / ``Qwen3OmniMoeProcessor`` build for the same frames and the same
decoded track with ``use_audio_in_video=True``: the token ids exactly, the mel features within
1e-6 absolute (measured: equal).

transformers' video processors need torchvision, which cannot load beside the CPU torch build here:
the processors get a stand-in video processor that returns dhp's own patches and grid of the video
(the grid and ``fps`` are all the token layout reads); everything else (the tokenizer, the feature
extractor, the audio/video interleaving) is transformers' own code. The track is handed over already
decoded (``audio_from_video_indices``), as transformers lets callers that decode themselves do.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from audio_build import write_mp4, write_photo_mp4, write_sine
from rich.console import Console
from transformers import AutoTokenizer, BatchFeature, WhisperFeatureExtractor

from dhp.config.schema import DataConfig, DatasetEntry, ModelConfig
from dhp.data import bad
from dhp.data.audio import load_audio, video_audio
from dhp.data.batch import AUDIO, TEXT, VIDEO
from dhp.data.check import check_data, render_report
from dhp.data.source import build_source
from dhp.data.video import process_video, read_frames

pytestmark = pytest.mark.unit
av = pytest.importorskip("av", reason="PyAV (dhp[video]) decodes a video's frames and audio track")

BIG = 1 << 20  # limits that never bind
DEMO = Path(__file__).resolve().parents[3] / "dhp" / "data_assets" / "demo" / "images"
FEATURE_ATOL = 1e-6  # mel features: dhp's unpadded frames vs the processor's within its 30-s padding

#: the special tokens' text per family, as the released tokenizers declare them (extra_special_tokens)
SPECIALS = {
    "qwen2_5_omni": {
        "image_token": "<|IMAGE|>",
        "audio_token": "<|AUDIO|>",
        "video_token": "<|VIDEO|>",
        "vision_bos_token": "<|vision_bos|>",
        "vision_eos_token": "<|vision_eos|>",
        "audio_bos_token": "<|audio_bos|>",
        "audio_eos_token": "<|audio_eos|>",
    },
    "qwen3_omni": {
        "image_token": "<|image_pad|>",
        "audio_token": "<|audio_pad|>",
        "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
        "audio_bos_token": "<|audio_start|>",
        "audio_eos_token": "<|audio_end|>",
    },
}


def _model(tmp_path_factory, family: str) -> ModelConfig:
    from dhp.models import get_family, make_tiny_checkpoint

    out = make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny_{family}"), family=family)
    return replace(get_family(family).tiny_model_config(), path=str(out))


@pytest.fixture(scope="module")
def omni25(tmp_path_factory) -> ModelConfig:
    return _model(tmp_path_factory, "qwen2_5_omni")


@pytest.fixture(scope="module")
def omni3(tmp_path_factory) -> ModelConfig:
    return _model(tmp_path_factory, "qwen3_omni")


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    """``talk.mp4`` (3 s, three photographs, chirp + sine at 44.1 kHz stereo), ``short.mp4`` (2 s, two
    photographs), ``silent.mp4`` (no audio track) and ``note.wav`` (a 0.7 s sine at 22.05 kHz)."""
    root = tmp_path_factory.mktemp("video_audio")
    write_photo_mp4(
        root / "talk.mp4", [DEMO / "cat.jpg", DEMO / "rocket.jpg", DEMO / "coins.jpg"], seconds=3.0
    )
    write_photo_mp4(root / "short.mp4", [DEMO / "astronaut.jpg", DEMO / "moon_surface.jpg"], seconds=2.0)
    write_mp4(root / "silent.mp4", audio_codec=None, seconds=1.0)
    write_sine(root / "note.wav", seconds=0.7, rate=22050, freq=660.0)
    return root


def _turns(user: str, answer: str = "A cat, a rocket and some coins, over a rising tone.") -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def _source(model: ModelConfig, root: Path, rows: list[dict]):
    path = root / f"d{abs(hash(json.dumps(rows))) % 10**8}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(kind="llava", datasets=[DatasetEntry(name="t", path=str(path))])
    return build_source(data=data, model=model, patch_seq_len=BIG, token_seq_len=BIG, seed=0)[0]


class _Frames:
    """Stand-in for transformers' video processor (torchvision-only here): dhp's patches and grid of
    each video, with the processor's ``merge_size`` and ``temporal_patch_size``."""

    def __init__(self, items, *, merge: int, temporal: int) -> None:
        self.items, self.merge_size, self.temporal_patch_size = items, merge, temporal

    def __call__(self, videos, **kwargs) -> BatchFeature:
        return BatchFeature(
            {
                "pixel_values_videos": torch.cat([v.pixel_values for v in self.items]),
                "video_grid_thw": torch.tensor([list(v.grid) for v in self.items]),
            }
        )


def _hf_processor(family: str, model: ModelConfig, proc, videos):
    """transformers' omni processor of the tiny checkpoint (its tokenizer with the family's special
    token names, its feature extractor, the image processor) around the :class:`_Frames` stand-in."""
    if family == "qwen2_5_omni":
        from transformers import Qwen2_5OmniProcessor as Base
    else:
        from transformers import Qwen3OmniMoeProcessor as Base

    class _Processor(Base):
        def check_argument_for_proper_class(self, name, arg):  # the stand-in is no VideoProcessor class
            return type(arg)

    tok = AutoTokenizer.from_pretrained(model.path, extra_special_tokens=SPECIALS[family])
    frames = _Frames(videos, merge=proc.merge, temporal=model.vision.temporal_patch_size)
    fe = WhisperFeatureExtractor.from_pretrained(model.path)
    return _Processor(
        image_processor=proc.image_processor, video_processor=frames, feature_extractor=fe, tokenizer=tok
    )


def _reference(family: str, model: ModelConfig, src, index: int):
    """transformers' processor output for record ``index``: the same text (the chat template's
    rendering with the family's placeholders), frames and decoded audio, ``use_audio_in_video=True``."""
    proc = src.processor
    rec = src.datasets[0].record(index)
    sp = SPECIALS[family]
    tags = {
        "<video>": sp["vision_bos_token"] + sp["video_token"] + sp["vision_eos_token"],
        "<audio>": sp["audio_bos_token"] + sp["audio_token"] + sp["audio_eos_token"],
    }
    messages = []
    for role, text in rec.turns:
        for tag, body in tags.items():
            text = text.replace(tag, body)
        messages.append({"role": role, "content": text})
    items = [process_video(p, spec=proc.video, loc="ref") for p in rec.videos]
    hf = _hf_processor(family, model, proc, items)
    text = hf.tokenizer.apply_chat_template(messages, tokenize=False)
    rate = int(proc.audio.extractor.sampling_rate)
    # the slots in text order: each <audio> file and each video's track, as transformers counts them
    slots, files, videos = [], iter(rec.audios), iter(range(len(rec.videos)))
    for _, turn in rec.turns:
        slots += [None if tag == "<audio>" else next(videos) for tag in re.findall(r"<audio>|<video>", turn)]
    waves = [
        load_audio(next(files), sampling_rate=rate, loc="ref", max_seconds=60)
        if s is None
        else video_audio(rec.videos[s], sampling_rate=rate, loc="ref", max_seconds=60)
        for s in slots
    ]
    frames = [read_frames(p, spec=proc.video, loc="ref") for p in rec.videos]
    fps = {f for _, f in frames}
    assert len(fps) == 1, fps  # one fps for the processor call
    return hf(
        text=[text],
        videos=[np.stack([np.asarray(im) for im in f]) for f, _ in frames],
        audio=waves,
        audio_from_video_indices=slots,
        use_audio_in_video=True,
        videos_kwargs={"fps": fps.pop()},
        return_tensors="pt",
    )


def _check_against_processor(family: str, model: ModelConfig, src, index: int) -> None:
    sample = src.load(index)
    ref = _reference(family, model, src, index)
    assert torch.equal(sample.input_ids, ref["input_ids"][0])
    tok = model.tokens
    want_types = torch.full_like(sample.input_ids, TEXT)
    want_types[sample.input_ids == tok.video_token_id] = VIDEO
    want_types[sample.input_ids == tok.audio_token_id] = AUDIO
    assert torch.equal(sample.mm_token_type_ids, want_types)
    mask = ref["feature_attention_mask"].bool()
    hf_lens = mask.sum(-1).tolist()
    lens = sample.audio_lens.view(-1).tolist()
    if family == "qwen3_omni":
        # Qwen3OmniMoeProcessor pads to the longest clip and keeps floor(samples / hop) frames; dhp keeps
        # ceil (Qwen2.5-Omni's 30-s padding rule) for every family: at most one frame more per clip,
        # the shared frames equal. The token ids above still match for these clips.
        assert all(n - m in (0, 1) for n, m in zip(lens, hf_lens, strict=True)), (lens, hf_lens)
    else:
        assert lens == hf_lens  # every audio, in slot order
    feats = sample.audio_features.split(lens)
    for i, m in enumerate(hf_lens):
        want = ref["input_features"][i][:, :m].T.to(torch.float32)
        torch.testing.assert_close(feats[i][:m], want, atol=FEATURE_ATOL, rtol=0)
    assert torch.equal(
        sample.image_grid_thw[-len(src.datasets[0].record(index).videos) :], ref["video_grid_thw"]
    )


VIDEO_ROWS = [
    # one video with its own sound
    {
        "messages": _turns("<video>What happens, and what do you hear?"),
        "videos": ["talk.mp4"],
        "use_audio_in_video": True,
    },
    # an audio file before two videos with their sound: the frames follow the tokens (file, track, track)
    {
        "messages": _turns("<audio>First this. Then <video> and <video>."),
        "audios": ["note.wav"],
        "videos": ["talk.mp4", "short.mp4"],
        "use_audio_in_video": True,
    },
    # a video with its sound before an audio file: the track's frames come first
    {
        "messages": _turns("<video>Compare with <audio>."),
        "audios": ["note.wav"],
        "videos": ["short.mp4"],
        "use_audio_in_video": True,
    },
]


def test_qwen2_5_omni_video_with_its_audio_is_the_processors_sample(omni25, media):
    """Qwen2.5-Omni: per 2-s chunk the chunk's video tokens then its audio tokens, between
    ``<|vision_bos|><|audio_bos|>`` and ``<|audio_eos|><|vision_eos|>``; ids, features and order as
    ``Qwen2_5OmniProcessor`` writes them."""
    src = _source(omni25, media, VIDEO_ROWS)
    for index in range(len(VIDEO_ROWS)):
        _check_against_processor("qwen2_5_omni", omni25, src, index)
    sample = src.load(0)
    ids = sample.input_ids.tolist()
    tok = omni25.tokens
    bos = ids.index(tok.vision_start_token_id)
    assert ids[bos + 1] == tok.audio_start_token_id  # the model side reads the flag from this pair
    body = ids[bos + 2 : ids.index(tok.audio_end_token_id)]
    runs = [(body[0], 1)]
    for i in body[1:]:
        runs[-1:] = [(i, runs[-1][1] + 1)] if i == runs[-1][0] else [runs[-1], (i, 1)]
    assert [r[0] for r in runs] == [tok.video_token_id, tok.audio_token_id] * 2  # two 2-s chunks in 3 s
    assert (sample.labels[sample.mm_token_type_ids != TEXT] == -100).all()


def test_qwen3_omni_video_with_its_audio_is_the_processors_sample(omni3, media):
    """Qwen3-Omni: video tokens placed among the audio tokens by their start times
    (``position_id_per_seconds``), as ``Qwen3OmniMoeProcessor`` writes them."""
    src = _source(omni3, media, VIDEO_ROWS)
    for index in range(len(VIDEO_ROWS)):
        _check_against_processor("qwen3_omni", omni3, src, index)


def test_a_video_without_sound_is_no_audio_track_and_check_counts_the_tracks(omni25, media):
    """A record asking for the track of a silent video is ``no_audio_track`` by name; ``dhp data check``
    counts the tracks' seconds and LLM tokens with the files'."""
    rows = [
        {
            "messages": _turns("<video>What do you hear?"),
            "videos": ["silent.mp4"],
            "use_audio_in_video": True,
        },
        VIDEO_ROWS[0],
        {"messages": _turns("<audio>And this?"), "audios": ["note.wav"]},
    ]
    src = _source(omni25, media, rows)
    with pytest.raises(bad.BadSampleError) as err:
        src.load(0)
    assert err.value.reason == bad.NO_AUDIO_TRACK and "silent.mp4" in err.value.detail
    path = media / "check.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(kind="llava", datasets=[DatasetEntry(name="t", path=str(path))], on_bad_sample="skip")
    report = check_data(data=data, model=omni25, patch_seq_len=BIG, token_seq_len=BIG)
    assert report.bad_counts == {bad.NO_AUDIO_TRACK: 1}
    assert report.video_audio_tracks == 1 and report.audio_files == 1
    track, note = src.load(1), src.load(2)
    assert report.audio_tokens == int(
        (track.mm_token_type_ids == AUDIO).sum() + (note.mm_token_type_ids == AUDIO).sum()
    )
    assert report.audio_seconds == pytest.approx(3.0 + 0.7, abs=0.1)  # AAC adds its priming frames
    console = Console(record=True, width=200)
    render_report(report, console=console)
    text = console.export_text()
    shown = f"audio in all: 1 file(s) and 1 video audio track(s), {report.audio_seconds:.1f} s"
    assert f"{shown}, {report.audio_tokens} LLM tokens" in text, text


def test_a_family_without_audio_refuses_a_videos_track_by_name(tiny_model, media):
    """Qwen2.5-VL (no audio encoder, no layout of a video with its audio): the record is refused,
    named, not trained without its sound."""
    from dhp.models import get_family

    assert (
        get_family("qwen2_5_vl").video_with_audio_ids(None, grid=(1, 2, 2), seconds=1.0, audio_tokens=3)
        is None
    )
    src = _source(tiny_model, media, [VIDEO_ROWS[0]])
    with pytest.raises(bad.BadSampleError) as err:
        src.load(0)
    assert err.value.reason == bad.UNSUPPORTED_MODALITY and "audio" in err.value.detail


@pytest.mark.parametrize(
    ("grid", "seconds", "n"),
    [
        ((3, 4, 4), 1.0, 75),
        ((4, 4, 6), 0.5, 3),
        ((3, 2, 2), 3.0, 160),
        ((2, 2, 2), 1.0, 0),
        ((1, 4, 4), 2.0, 51),
    ],
)
def test_qwen2_5_omni_interleaving_is_the_processors_rule(omni25, grid, seconds, n):
    """The family hook equals ``Qwen2_5OmniProcessor.replace_video_with_audio_token`` (called on a
    stand-in naming each token by one letter) for chunk-aligned, sparse (a gap of several chunks),
    silent and audio-longer-than-video cases, with the checkpoint config's numbers."""
    import types

    from transformers import Qwen2_5OmniProcessor

    from dhp.models import get_family

    family = get_family("qwen2_5_omni")
    cfg = family.hf_config_from_dir(omni25.path)
    letters = {cfg.audio_start_token_id: "<", cfg.audio_end_token_id: ">", cfg.video_token_id: "V"}
    letters[cfg.audio_token_id] = "A"
    stand_in = types.SimpleNamespace(
        audio_bos_token="<",
        audio_eos_token=">",
        video_token="V",
        audio_token="A",
        video_processor=types.SimpleNamespace(merge_size=cfg.vision_config.spatial_merge_size),
        get_chunked_index=lambda idx, per: Qwen2_5OmniProcessor.get_chunked_index(None, idx, per),
    )
    want = Qwen2_5OmniProcessor.replace_video_with_audio_token(
        stand_in,
        {"video_grid_thw": [grid], "video_second_per_grid": [seconds]},
        0,
        {"num_audio_tokens": [n]},
        0,
        position_id_per_seconds=cfg.position_id_per_seconds,
        seconds_per_chunk=cfg.seconds_per_chunk,
    )
    got = family.video_with_audio_ids(cfg, grid=grid, seconds=seconds, audio_tokens=n)
    assert "".join(letters[i] for i in got) == want


def test_a_sample_over_the_audio_encoders_seq_len_is_audio_too_long_by_its_key(omni25, media):
    """The audio encoder's ``seq_len`` (what the plan sizes it for: one sample's mel frames) bounds
    every sample's frames, files and video tracks together: over it, the bad sample ``audio_too_long``
    names ``modules.audio.seq_len``; at it, the sample loads; without the run's seq_lens, no bound."""
    rows = [{"messages": _turns("<audio><audio>Two clips?"), "audios": ["note.wav", "note.wav"]}]
    path = media / "two_clips.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(kind="llava", datasets=[DatasetEntry(name="t", path=str(path))])
    frames = int(build_source(data=data, model=omni25, patch_seq_len=BIG, token_seq_len=BIG, seed=0)[0]
                 .load(0).audio_lens.sum())  # fmt: skip
    assert frames > 100  # two 0.7-s clips at 100 frames a second
    for limit, fits in ((frames, True), (frames - 1, False)):
        seq = {"audio": limit, "vision": BIG, "llm": BIG}
        src = build_source(
            data=data, model=omni25, patch_seq_len=BIG, token_seq_len=BIG, seed=0, seq_lens=seq
        )[0]
        if fits:
            assert int(src.load(0).audio_lens.sum()) == frames
            continue
        with pytest.raises(bad.BadSampleError) as err:
            src.load(0)
        assert err.value.reason == bad.AUDIO_TOO_LONG
        assert (
            f"> modules.audio.seq_len={limit}" in err.value.detail
            and "modules.audio.seq_len" in err.value.fix
        )
