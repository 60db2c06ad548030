"""Audio decoding on real files: every format decodes to float32 mono at the asked rate with its
frequency kept; each bad clip is its own named reason; a video's audio track through PyAV."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
from audio_build import peak_hz, sine, write_mp4, write_sine

from dhp.data import bad
from dhp.data.audio import audio_seconds, load_audio, video_audio, video_audio_seconds

pytestmark = pytest.mark.unit
RATE = 16000  # the rate every clip is decoded to (Whisper-style encoders read 16 kHz)
LOC = "clips.jsonl:3"


def _load(path, *, max_seconds: float = 30.0) -> np.ndarray:
    return load_audio(path, sampling_rate=RATE, loc=LOC, max_seconds=max_seconds)


def _reason(fn, *args, **kw) -> bad.BadSampleError:
    with pytest.raises(bad.BadSampleError) as info:
        fn(*args, **kw)
    err = info.value
    assert err.location == LOC and err.fix, err
    return err


@pytest.mark.parametrize(
    ("fmt", "suffix", "rate"),
    [("WAV", "wav", 44100), ("FLAC", "flac", 48000), ("OGG", "ogg", 22050), ("MP3", "mp3", 44100)],
)
def test_each_format_decodes_to_mono_at_the_rate_with_its_frequency(tmp_path, fmt, suffix, rate):
    if fmt not in sf.available_formats():
        pytest.skip(f"this libsndfile ({sf.__libsndfile_version__}) has no {fmt} support")
    seconds, freq = 1.5, 440.0
    path = write_sine(
        tmp_path / f"clip.{suffix}", seconds=seconds, rate=rate, freq=freq, channels=2, format=fmt
    )
    y = _load(path)
    assert y.dtype == np.float32 and y.ndim == 1
    assert abs(len(y) - seconds * RATE) <= 1  # resampled length: seconds * 16000 within one sample
    assert abs(peak_hz(y, RATE) - freq) <= RATE / len(y)  # the peak stays in the sine's FFT bin
    # amplitude kept (lossy codecs and the resampler's passband: within 3 %)
    assert np.sqrt(np.mean(y**2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.03)
    assert np.abs(y).max() <= 1.0
    assert audio_seconds(path) == pytest.approx(seconds, abs=1 / rate)  # header only


def test_channels_are_averaged_not_picked_or_summed(tmp_path):
    left, right = sine(300.0, 1.0, RATE, amp=0.8), sine(1200.0, 1.0, RATE, amp=0.4)
    path = tmp_path / "two.wav"
    sf.write(str(path), np.stack([left, right], axis=1), RATE, subtype="FLOAT")  # exact samples
    y = _load(path)  # same rate: no resampling, so the mean is exact
    np.testing.assert_allclose(y, (left + right) / 2, atol=1e-7)


def test_values_beyond_full_scale_are_clipped(tmp_path):
    path = tmp_path / "loud.wav"
    sf.write(str(path), sine(50.0, 0.5, RATE, amp=1.5), RATE, subtype="FLOAT")
    y = _load(path)
    assert y.max() == 1.0 and y.min() == -1.0


def test_a_truncated_header_is_corrupt_audio(tmp_path):
    whole = write_sine(tmp_path / "whole.wav").read_bytes()
    cut = tmp_path / "cut.wav"
    cut.write_bytes(whole[:30])  # RIFF header cut inside the fmt chunk
    assert _reason(_load, cut).reason == bad.CORRUPT_AUDIO
    junk = tmp_path / "junk.mp3"
    junk.write_bytes(b"not an mpeg stream " * 20)
    err = _reason(_load, junk)
    assert err.reason == bad.CORRUPT_AUDIO and str(junk) in err.detail
    with pytest.raises(bad.BadSampleError) as info:
        audio_seconds(cut, loc=LOC)
    assert info.value.reason == bad.CORRUPT_AUDIO


def test_zero_frames_is_empty_audio(tmp_path):
    path = tmp_path / "empty.wav"
    sf.write(str(path), np.zeros((0, 1), np.float32), RATE)
    assert _reason(_load, path).reason == bad.EMPTY_AUDIO
    assert audio_seconds(path) == 0.0


def test_too_long_is_decided_from_the_header_before_decoding(tmp_path, monkeypatch):
    path = write_sine(tmp_path / "long.flac", seconds=2.0, rate=44100)
    reads = []
    original = sf.SoundFile.read

    def counted(self, *args, **kw):  # the real read, counted
        reads.append(kw.get("frames"))
        return original(self, *args, **kw)

    monkeypatch.setattr(sf.SoundFile, "read", counted)
    err = _reason(_load, path, max_seconds=1.0)
    assert err.reason == bad.AUDIO_TOO_LONG and "2.00 s" in err.detail
    assert reads == []  # refused on the header: no sample decoded
    assert len(_load(path, max_seconds=2.0)) == 2 * RATE  # exactly at the limit is not too long
    assert reads == [2 * 44100 + 1]  # the decode never asks past the limit


def test_non_finite_samples_are_corrupt_audio(tmp_path):
    x = sine(440.0, 0.25, RATE)
    x[100] = np.nan
    path = tmp_path / "nan.wav"
    sf.write(str(path), x, RATE, subtype="FLOAT")
    assert _reason(_load, path).reason == bad.CORRUPT_AUDIO


def test_missing_and_directory_paths_name_their_reason(tmp_path):
    assert _reason(_load, tmp_path / "gone.wav").reason == bad.MISSING_FILE
    (tmp_path / "folder.wav").mkdir()
    assert _reason(_load, tmp_path / "folder.wav").reason == bad.NOT_A_FILE


@pytest.fixture(scope="module")
def av():
    return pytest.importorskip("av", reason="PyAV (dhp[video]) decodes a video's audio track")


def _mp4(av, path, codec: str | None = "aac", **kw):
    for needed in ("mpeg4", codec):
        if needed is not None and needed not in av.codecs_available:
            pytest.skip(f"this PyAV/FFmpeg build has no {needed} encoder")
    return write_mp4(path, audio_codec=codec, **kw)


@pytest.mark.parametrize("codec", ["aac", "mp3"])
def test_a_videos_audio_track_decodes_to_mono_at_the_rate(av, tmp_path, codec):
    path = _mp4(av, tmp_path / "talk.mp4", codec, seconds=1.0, rate=44100, freq=1000.0)
    assert video_audio_seconds(path, loc=LOC) == pytest.approx(1.0, abs=0.05)  # header
    y = video_audio(path, sampling_rate=RATE, loc=LOC, max_seconds=30.0)
    assert y.dtype == np.float32 and y.ndim == 1
    # the codec adds its priming and last-frame padding (at most two 1152-sample frames at 44.1 kHz)
    assert RATE - 1 <= len(y) <= RATE + 2 * 1152 * RATE / 44100 + 1
    assert abs(peak_hz(y, RATE) - 1000.0) <= RATE / len(y)
    assert np.abs(y).max() <= 1.0


def test_a_video_without_sound_or_over_the_limit_is_named(av, tmp_path):
    silent = _mp4(av, tmp_path / "silent.mp4", None)
    err = _reason(video_audio, silent, sampling_rate=RATE, loc=LOC, max_seconds=30.0)
    assert err.reason == bad.NO_AUDIO_TRACK
    assert _reason(video_audio_seconds, silent, loc=LOC).reason == bad.NO_AUDIO_TRACK
    frames = tmp_path / "frames"
    frames.mkdir()
    assert _reason(video_audio_seconds, frames, loc=LOC).reason == bad.NO_AUDIO_TRACK
    talk = _mp4(av, tmp_path / "talk.mp4", seconds=1.0)
    err = _reason(video_audio, talk, sampling_rate=RATE, loc=LOC, max_seconds=0.5)
    assert err.reason == bad.AUDIO_TOO_LONG
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"\x00" * 512)
    assert _reason(video_audio, junk, sampling_rate=RATE, loc=LOC, max_seconds=30.0).reason == (
        bad.CORRUPT_AUDIO
    )
