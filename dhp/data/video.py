"""Video samples: decode, sample frames by time, resize, and cut into temporal patches.

A video is a folder of frames (image files, sorted by name; needs nothing beyond Pillow) or a video
file decoded by PyAV (``av``, the FFmpeg binding; optional, ``pip install dhp[video]``). Sampling:
``data.video_fps`` frames per second of the clip's duration, at most ``data.video_max_frames``,
rounded down to a multiple of ``temporal_patch_size`` (at least one temporal patch), spread evenly
over the clip. A frames folder is taken to be recorded at ``data.video_folder_fps``. Each frame is
resized to the same ``(h, w)``, multiples of ``patch_size * merge``, with ``h * w`` within
``[data.video_min_pixels, data.video_max_pixels]``, then normalised with the image processor's mean
and std.

Temporal patches: frames ``2t`` and ``2t+1`` (``temporal_patch_size`` 2) form temporal patch ``t``;
rows are ``(t, h/m, w/m, m, m)`` in that order, columns ``(C, T, P, P)``: the layout transformers'
video processor of the model family produces, so the encoder reads a video as an item of grid ``(t, h, w)``.
``second_per_grid_ts = temporal_patch_size / sampled fps`` sets the temporal M-RoPE stride.

Memory per video: ``frames x h x w x 3`` float32 while patching, then the rows (the same bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dhp.data import bad

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


@dataclass(frozen=True)
class VideoSpec:
    """Sampling and geometry of the model's video input (from ``data.video_*`` and the vision arch)."""

    fps: float
    max_frames: int
    folder_fps: float
    min_pixels: int
    max_pixels: int
    patch_size: int
    merge: int
    temporal_patch_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass
class VideoItem:
    """One processed video: patch rows ``(t*h*w, C*T*P*P)``, grid ``(t, h, w)``, seconds per temporal patch."""

    pixel_values: torch.Tensor
    grid: tuple[int, int, int]
    second_per_grid_t: float

    def tokens(self, merge: int) -> int:
        """LLM tokens of this video: ``t * h * w / merge**2``."""
        t, h, w = self.grid
        return t * h * w // merge**2


def _bad(loc: str, reason: str, detail: str, fix: str) -> bad.BadSampleError:
    return bad.BadSampleError(location=loc, reason=reason, detail=detail, fix=fix)


def read_frames(path: Path, *, spec: VideoSpec, loc: str) -> tuple[list, float]:
    """The sampled frames (PIL images) of ``path`` and the sampled fps. BadSampleError when the video is
    missing, cannot be decoded, or has no frames."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
        if not files:
            raise _bad(
                loc, bad.EMPTY_VIDEO, f"video folder {path} holds no frames {FRAME_SUFFIXES}", "add frames"
            )
        keep, fps = sample_indices(len(files), native_fps=spec.folder_fps, spec=spec)
        from dhp.data.images import open_image

        return [open_image(files[i], loc=loc) for i in keep], fps
    if not path.exists():
        raise _bad(loc, bad.MISSING_FILE, f"video {path} does not exist", "restore the file or fix the path")
    frames, native = _decode_file(path, loc=loc)
    if not frames:
        raise _bad(
            loc, bad.EMPTY_VIDEO, f"video {path} decodes to zero frames", "re-encode or drop the video"
        )
    keep, fps = sample_indices(len(frames), native_fps=native, spec=spec)
    return [frames[i] for i in keep], fps


def _decode_file(path: Path, *, loc: str) -> tuple[list, float]:
    """All frames of a video file as RGB PIL images, and its frame rate (PyAV)."""
    try:
        import av
    except ImportError as e:
        raise _bad(
            loc,
            bad.CORRUPT_VIDEO,
            f"video file {path} needs PyAV to decode, which is not installed",
            "pip install 'dhp[video]' (PyAV), or give a folder of frames instead",
        ) from e
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or 0) or 1.0
            frames = [f.to_image().convert("RGB") for f in container.decode(stream)]
    except (av.FFmpegError, IndexError, ValueError, OSError) as e:
        raise _bad(
            loc, bad.CORRUPT_VIDEO, f"video {path} cannot be decoded ({e})", "re-encode it (e.g. H.264 MP4)"
        ) from e
    return frames, rate


def sample_indices(n: int, *, native_fps: float, spec: VideoSpec) -> tuple[list[int], float]:
    """Evenly spread frame indices of an ``n``-frame clip at ``native_fps`` and the fps they sample."""
    duration = n / native_fps
    t = spec.temporal_patch_size
    want = min(spec.max_frames, max(t, round(duration * spec.fps)), max(n, t))
    want = max(t, want - want % t)
    keep = [min(n - 1, round(i * (n - 1) / max(want - 1, 1))) for i in range(want)] if n > 1 else [0] * want
    return keep, want / duration


def frame_size(height: int, width: int, *, spec: VideoSpec) -> tuple[int, int]:
    """``(h, w)`` multiples of ``patch * merge``, aspect kept, ``h * w`` within the pixel bounds."""
    f = spec.patch_size * spec.merge
    h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
    if h * w > spec.max_pixels:
        s = math.sqrt(height * width / spec.max_pixels)
        h, w = max(f, math.floor(height / s / f) * f), max(f, math.floor(width / s / f) * f)
    elif h * w < spec.min_pixels:
        s = math.sqrt(spec.min_pixels / (height * width))
        h, w = math.ceil(height * s / f) * f, math.ceil(width * s / f) * f
    return h, w


def temporal_patches(frames: np.ndarray, *, spec: VideoSpec) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``(n, C, H, W)`` normalised frames (``n`` a multiple of T) -> rows ``(t*h*w, C*T*P*P)`` and grid."""
    n, c, height, width = frames.shape
    p, m, tp = spec.patch_size, spec.merge, spec.temporal_patch_size
    t, h, w = n // tp, height // p, width // p
    x = frames.reshape(t, tp, c, h // m, m, p, w // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, h/m, w/m, m, m, C, T, P, P)
    return torch.from_numpy(np.ascontiguousarray(x).reshape(t * h * w, c * tp * p * p)), (t, h, w)


def process_video(path: Path, *, spec: VideoSpec, loc: str) -> VideoItem:
    """Decode, sample, resize, normalise and patch one video (see the module docstring)."""
    from PIL import Image

    frames, fps = read_frames(path, spec=spec, loc=loc)
    sizes = {im.size for im in frames}
    if len(sizes) != 1:
        raise _bad(
            loc,
            bad.CORRUPT_VIDEO,
            f"video {path} has frames of several sizes {sorted(sizes)}",
            "use one frame size",
        )
    w0, h0 = frames[0].size
    h, w = frame_size(h0, w0, spec=spec)
    mean = np.asarray(spec.mean, dtype=np.float32)[:, None, None]
    std = np.asarray(spec.std, dtype=np.float32)[:, None, None]
    arr = np.stack(
        [
            (
                np.asarray(im.convert("RGB").resize((w, h), Image.BICUBIC), dtype=np.float32).transpose(
                    2, 0, 1
                )
                / 255.0
                - mean
            )
            / std
            for im in frames
        ]
    )
    rows, grid = temporal_patches(arr, spec=spec)
    return VideoItem(
        pixel_values=rows.to(torch.float32), grid=grid, second_per_grid_t=spec.temporal_patch_size / fps
    )


def video_spec(data, *, vision, image_processor) -> VideoSpec:
    """The :class:`VideoSpec` of ``data`` (DataConfig), the vision arch and the image processor's norms."""
    return VideoSpec(
        fps=data.video_fps,
        max_frames=data.video_max_frames,
        folder_fps=data.video_folder_fps,
        min_pixels=data.video_min_pixels,
        max_pixels=data.video_max_pixels,
        patch_size=vision.patch_size,
        merge=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size,
        mean=tuple(float(v) for v in image_processor.image_mean),
        std=tuple(float(v) for v in image_processor.image_std),
    )


def reference_visual_kwargs(batch) -> dict:
    """A batch's visual items split into the separate image and video inputs of transformers'
    vision-language models (``pixel_values``/``image_grid_thw``, ``pixel_values_videos``/``video_grid_thw``/
    ``second_per_grid_ts``), for single-process references. Items are told apart by their token runs."""
    from dhp.data.batch import AUDIO, IMAGE, VIDEO
    from dhp.data.remote import as_tensor

    pixels, grids = as_tensor(batch.pixel_values), batch.image_grid_thw
    if grids is None or not bool((batch.mm_token_type_ids == VIDEO).any()):
        return {"pixel_values": pixels, "image_grid_thw": grids}
    import itertools

    # a video interleaved with its own audio track (its chunks' video tokens, then their audio tokens)
    # is one video: audio positions are left out before the runs are told apart
    kinds = [
        k
        for row in batch.mm_token_type_ids.tolist()
        for k, _ in itertools.groupby(t for t in row if t != AUDIO)
        if k in (IMAGE, VIDEO)
    ]
    is_video = torch.tensor([k == VIDEO for k in kinds])
    rows = torch.repeat_interleave(is_video, grids.prod(dim=1))
    return {
        "pixel_values": pixels[~rows] if bool((~is_video).any()) else None,
        "image_grid_thw": grids[~is_video] if bool((~is_video).any()) else None,
        "pixel_values_videos": pixels[rows],
        "video_grid_thw": grids[is_video],
        "second_per_grid_ts": batch.second_per_grid_ts,
    }
