"""Real audio and video files for the audio tests: sines written by soundfile, MP4s encoded by PyAV."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import soundfile as sf


def sine(freq: float, seconds: float, rate: int, *, amp: float = 0.5) -> np.ndarray:
    """``amp * sin(2 pi freq t)`` as float32, ``round(seconds * rate)`` samples."""
    t = np.arange(round(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def write_sine(
    path: Path, *, seconds: float = 1.0, rate: int = 16000, freq: float = 440.0, channels: int = 1, **kw
) -> Path:
    """A sine clip written by soundfile (format from the suffix unless ``format=`` is given)."""
    x = np.repeat(sine(freq, seconds, rate)[:, None], channels, axis=1)
    sf.write(str(path), x, rate, **kw)
    return path


def write_tar(path: Path, members: dict[str, bytes]) -> Path:
    """An uncompressed tar shard holding ``members`` (name -> bytes), in order."""
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def peak_hz(y: np.ndarray, rate: int) -> float:
    """The frequency of the largest FFT bin of ``y`` (Hann-windowed); resolution ``rate / len(y)``."""
    spec = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    return float(np.argmax(spec)) * rate / len(y)


def write_mp4(
    path: Path,
    *,
    audio_codec: str | None = "aac",
    seconds: float = 1.0,
    rate: int = 44100,
    freq: float = 1000.0,
) -> Path:
    """A tiny MP4 (32x32 mpeg4 video at 10 fps) with a stereo sine audio track in ``audio_codec``
    (None: no audio track), encoded by PyAV."""
    import av  # optional (dhp[video]); the callers skip without it

    with av.open(str(path), "w") as container:
        video = container.add_stream("mpeg4", rate=10)
        video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
        audio = None
        if audio_codec is not None:
            audio = container.add_stream(audio_codec, rate=rate)
            audio.layout = "stereo"
        for i in range(round(seconds * 10)):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 20 * i % 255, np.uint8), format="rgb24")
            for packet in video.encode(frame):
                container.mux(packet)
        if audio is not None:
            signal = sine(freq, seconds, rate)
            step = audio.codec_context.frame_size or 1024
            for start in range(0, len(signal), step):
                chunk = np.ascontiguousarray(np.stack([signal[start : start + step]] * 2))
                frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
                frame.sample_rate, frame.pts = rate, start
                for packet in audio.encode(frame):
                    container.mux(packet)
            for packet in audio.encode(None):
                container.mux(packet)
        for packet in video.encode(None):
            container.mux(packet)
    return path


def chirp(
    seconds: float, rate: int, *, f0: float = 300.0, f1: float = 3000.0, amp: float = 0.4
) -> np.ndarray:
    """A linear chirp from ``f0`` to ``f1`` Hz over ``seconds`` as float32, ``round(seconds * rate)`` samples."""
    t = np.arange(round(seconds * rate)) / rate
    phase = 2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * seconds))
    return (amp * np.sin(phase)).astype(np.float32)


def write_photo_mp4(
    path: Path,
    photos: list[Path],
    *,
    seconds: float = 3.0,
    fps: int = 10,
    size: tuple[int, int] = (64, 48),
    rate: int = 44100,
) -> Path:
    """An MP4 of real photographs (each shown for an equal share of ``seconds``, resized to ``size`` =
    (width, height), mpeg4 at ``fps``) with a stereo chirp audio track (AAC at ``rate``: 300 Hz -> 3 kHz
    on the left, a 440 Hz sine on the right), encoded by PyAV."""
    import av  # optional (dhp[video]); the callers skip without it
    from PIL import Image

    width, height = size
    pictures = [np.asarray(Image.open(p).convert("RGB").resize(size)) for p in photos]
    n_frames = round(seconds * fps)
    with av.open(str(path), "w") as container:
        video = container.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        audio = container.add_stream("aac", rate=rate)
        audio.layout = "stereo"
        for i in range(n_frames):
            frame = av.VideoFrame.from_ndarray(pictures[i * len(pictures) // n_frames], format="rgb24")
            for packet in video.encode(frame):
                container.mux(packet)
        left, right = chirp(seconds, rate), sine(440.0, seconds, rate, amp=0.3)
        step = audio.codec_context.frame_size or 1024
        for start in range(0, len(left), step):
            chunk = np.ascontiguousarray(np.stack([left[start : start + step], right[start : start + step]]))
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
            frame.sample_rate, frame.pts = rate, start
            for packet in audio.encode(frame):
                container.mux(packet)
        for packet in audio.encode(None):
            container.mux(packet)
        for packet in video.encode(None):
            container.mux(packet)
    return path
