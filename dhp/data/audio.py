"""Audio samples: decode an audio file (or a video's audio track) to float32 mono at one rate.

Audio files (WAV, FLAC, OGG/Vorbis, MP3, ...) are read by ``soundfile`` (libsndfile 1.1+ decodes MP3);
a video file's audio track by PyAV (``av``, optional: ``pip install 'dhp[video]'``). Channels are
averaged to mono, then ``soxr`` resamples to ``sampling_rate``; values beyond full scale (float files,
resampling ringing) are clipped to [-1, 1]. Nothing is cut: a clip longer than ``max_seconds`` is
``audio_too_long``, decided from the file's header before the samples are decoded, and the decode
itself stops one sample past the limit (so a header that under-reports its length cannot make it
read a long file whole).

Memory per clip: the decoded samples at the file's rate and channels (float32), then one mono copy
at ``sampling_rate``; at most ``max_seconds`` of them.

Bad clips, each a :class:`~dhp.data.bad.BadSampleError`: ``missing_file``/``not_a_file``/``symlink_loop``
(the path), ``corrupt_audio`` (no decoder reads it, or it holds NaN/inf), ``empty_audio`` (zero
samples), ``audio_too_long``, ``no_audio_track`` (a video without an audio stream).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

from dhp.data import bad
from dhp.data.images import check_file

_SF_ERRORS = (sf.SoundFileError, RuntimeError, OSError, ValueError)  # libsndfile's open/read failures


def _bad(loc: str, reason: str, detail: str, fix: str) -> bad.BadSampleError:
    return bad.BadSampleError(location=loc, reason=reason, detail=detail, fix=fix)


def _corrupt(loc: str, label: str, err: Exception) -> bad.BadSampleError:
    return _bad(
        loc,
        bad.CORRUPT_AUDIO,
        f"{label} cannot be decoded ({str(err).splitlines()[0] if str(err) else type(err).__name__})",
        "re-encode it (e.g. 16-bit WAV or FLAC) or drop it",
    )


def check_seconds(seconds: float, *, label: str, loc: str, max_seconds: float) -> None:
    """The clip rules on a length: zero samples is ``empty_audio``, over ``max_seconds`` ``audio_too_long``."""
    if seconds <= 0:
        raise _bad(loc, bad.EMPTY_AUDIO, f"{label} holds zero samples", "drop the audio or re-export it")
    if seconds > max_seconds:
        raise _bad(
            loc,
            bad.AUDIO_TOO_LONG,
            f"{label} is {seconds:.2f} s, over the limit of {max_seconds:g} s",
            "cut the clip into shorter ones (each with its own text), or raise the audio length limit",
        )


def audio_seconds(path: Path, *, loc: str | None = None) -> float:
    """The length of an audio file in seconds, from its header only (nothing decoded); 0.0 when it
    holds no samples. BadSampleError when the file is missing or no decoder opens it."""
    loc = str(path) if loc is None else loc
    check_file(path, loc=loc, kind="audio")
    try:
        info = sf.info(str(path))
    except _SF_ERRORS as e:
        raise _corrupt(loc, f"audio {path}", e) from e
    return info.frames / info.samplerate if info.samplerate > 0 else 0.0


def mono_at(samples: np.ndarray, *, rate: int, sampling_rate: int) -> np.ndarray:
    """``(frames, channels)`` float32 at ``rate`` -> ``(frames',)`` float32 mono at ``sampling_rate``,
    channels averaged, resampled by soxr, clipped to [-1, 1]."""
    mono = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    if rate != sampling_rate:
        mono = soxr.resample(mono, rate, sampling_rate)
    return np.clip(mono, -1.0, 1.0, out=np.ascontiguousarray(mono, dtype=np.float32))


def _finite(samples: np.ndarray, *, label: str, loc: str) -> None:
    if not np.isfinite(samples).all():
        raise _bad(loc, bad.CORRUPT_AUDIO, f"{label} holds NaN or infinite samples", "re-export the file")


def load_audio(path: Path, *, sampling_rate: int, loc: str, max_seconds: float) -> np.ndarray:
    """An audio file as float32 mono in [-1, 1] at ``sampling_rate`` (see the module docstring).

    The header's length is checked against ``max_seconds`` before any sample is decoded."""
    check_file(path, loc=loc, kind="audio")
    label = f"audio {path}"
    try:
        with sf.SoundFile(str(path)) as f:
            rate, frames = f.samplerate, f.frames
            check_seconds(frames / rate, label=label, loc=loc, max_seconds=max_seconds)
            cap = math.floor(max_seconds * rate) + 1 if math.isfinite(max_seconds) else -1
            samples = f.read(frames=cap, dtype="float32", always_2d=True)
    except bad.BadSampleError:
        raise
    except _SF_ERRORS as e:
        raise _corrupt(loc, label, e) from e
    check_seconds(len(samples) / rate, label=f"{label} (decoded)", loc=loc, max_seconds=max_seconds)
    _finite(samples, label=label, loc=loc)
    return mono_at(samples, rate=rate, sampling_rate=sampling_rate)


def _av(path: Path, *, loc: str):
    """The PyAV module, or a bad sample that says how to install it."""
    try:
        import av  # optional (dhp[video]): only video files need it
    except ImportError as e:
        raise _bad(
            loc,
            bad.CORRUPT_AUDIO,
            f"the audio track of video {path} needs PyAV to decode, which is not installed",
            "pip install 'dhp[video]' (PyAV)",
        ) from e
    return av


def _audio_stream(container, *, path: Path, loc: str):
    if not container.streams.audio:
        raise _bad(
            loc,
            bad.NO_AUDIO_TRACK,
            f"video {path} has no audio track, and the record asks for it (use_audio_in_video)",
            "give a video with sound, or set use_audio_in_video to false for this record",
        )
    return container.streams.audio[0]


def _frames_folder(path: Path, *, loc: str) -> None:
    if path.is_dir():
        raise _bad(
            loc,
            bad.NO_AUDIO_TRACK,
            f"video {path} is a folder of frames, which has no audio track (use_audio_in_video)",
            "give the video file with its sound, or set use_audio_in_video to false for this record",
        )


def _header_seconds(container, stream) -> float | None:
    """The audio track's length from the stream (else container) header; None when neither says."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / 1_000_000  # AV_TIME_BASE: microseconds
    return None


def video_audio_seconds(path: Path, *, loc: str | None = None) -> float:
    """The length of a video file's audio track in seconds, from the headers (else the summed packet
    durations: demuxed, not decoded). BadSampleError when there is no audio track or PyAV cannot
    open the file."""
    loc = str(path) if loc is None else loc
    _frames_folder(path, loc=loc)
    check_file(path, loc=loc, kind="video")
    av = _av(path, loc=loc)
    try:
        with av.open(str(path)) as container:
            stream = _audio_stream(container, path=path, loc=loc)
            seconds = _header_seconds(container, stream)
            if seconds is None:
                ticks = sum(p.duration or 0 for p in container.demux(stream))
                seconds = float(ticks * stream.time_base) if stream.time_base else 0.0
    except bad.BadSampleError:
        raise
    except (av.FFmpegError, IndexError, ValueError, OSError) as e:
        raise _corrupt(loc, f"the audio track of video {path}", e) from e
    return seconds


def video_audio(path: Path, *, sampling_rate: int, loc: str, max_seconds: float) -> np.ndarray:
    """A video file's (first) audio track as float32 mono in [-1, 1] at ``sampling_rate``: the same
    rules as :func:`load_audio`; ``no_audio_track`` when the file has none (or is a frames folder)."""
    _frames_folder(path, loc=loc)
    check_file(path, loc=loc, kind="video")
    av = _av(path, loc=loc)
    label = f"the audio track of video {path}"
    try:
        with av.open(str(path)) as container:
            stream = _audio_stream(container, path=path, loc=loc)
            header = _header_seconds(container, stream)
            if header is not None:
                check_seconds(header, label=label, loc=loc, max_seconds=max_seconds)
            samples, rate = _decode_track(
                av, container, stream, label=label, loc=loc, max_seconds=max_seconds
            )
    except bad.BadSampleError:
        raise
    except (av.FFmpegError, IndexError, ValueError, OSError) as e:
        raise _corrupt(loc, label, e) from e
    check_seconds(len(samples) / rate, label=f"{label} (decoded)", loc=loc, max_seconds=max_seconds)
    _finite(samples, label=label, loc=loc)
    return mono_at(samples, rate=rate, sampling_rate=sampling_rate)


def _decode_track(av, container, stream, *, label: str, loc: str, max_seconds: float):
    """The track's samples ``(frames, channels)`` float32 and its rate; stops with ``audio_too_long``
    once more than ``max_seconds`` are decoded (ValueError when the channel count changes mid-track)."""
    rate = int(stream.rate or stream.codec_context.sample_rate or 0)
    if rate <= 0:
        raise _bad(loc, bad.CORRUPT_AUDIO, f"{label} declares no sample rate", "re-encode the video")
    to_float = av.AudioResampler(format="fltp")  # planar float32, channels and rate kept
    cap = max_seconds * rate
    planes, total = [], 0
    for frame in container.decode(stream):
        for out in to_float.resample(frame):
            block = out.to_ndarray()
            planes.append(block)
            total += block.shape[1]
        if total > cap:
            check_seconds(total / rate, label=label, loc=loc, max_seconds=max_seconds)
    for out in to_float.resample(None):
        planes.append(out.to_ndarray())
    samples = np.concatenate(planes, axis=1).T if planes else np.zeros((0, 1), np.float32)
    return samples, rate


@dataclass(frozen=True)
class RecordAudio:
    """A record's audio lengths in seconds, from headers only: each ``<audio>`` file in order, and each
    video's audio track when the record sets ``use_audio_in_video``."""

    files: tuple[float, ...] = ()
    tracks: tuple[float, ...] = ()

    @property
    def seconds(self) -> float:
        """Every clip's seconds, summed."""
        return sum(self.files) + sum(self.tracks)

    def tokens(self, audio_tokens) -> int:
        """LLM positions of all the clips under the model family's ``audio_tokens(seconds) -> int``."""
        return sum(audio_tokens(s) for s in (*self.files, *self.tracks))


def record_audio(rec, *, max_seconds: float = math.inf) -> RecordAudio:
    """The :class:`RecordAudio` of ``rec`` (a :class:`~dhp.data.records.Record`), the clip rules applied
    on the headers: a missing or unreadable file, ``empty_audio``, ``audio_too_long``, ``no_audio_track``.
    Reads headers only (no sample is decoded)."""
    loc = rec.location
    files = []
    for path in rec.audios:
        seconds = audio_seconds(path, loc=loc)
        check_seconds(seconds, label=f"audio {path}", loc=loc, max_seconds=max_seconds)
        files.append(seconds)
    tracks = []
    for path in rec.videos if rec.use_audio_in_video else ():
        seconds = video_audio_seconds(path, loc=loc)
        check_seconds(seconds, label=f"the audio track of video {path}", loc=loc, max_seconds=max_seconds)
        tracks.append(seconds)
    return RecordAudio(files=tuple(files), tracks=tuple(tracks))
