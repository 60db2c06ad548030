"""The unit of data the runtime moves: one processed :class:`Sample` and one micro-batch :class:`VLBatch`.

All tensors are CPU tensors. A ``Sample`` is one conversation after chat-template rendering, image
processing and image-token expansion; a ``VLBatch`` right-pads ``B`` samples to the longest one and
concatenates their images in order (contract in docs/INTERFACES.md, "Batch").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dhp.ops.cross_entropy import IGNORE_INDEX  # the one definition (re-exported here)
from dhp.ops.packed import AUDIO, IMAGE, TEXT, VIDEO  # noqa: F401 (mm_token_type_ids values, re-exported here)


@dataclass
class Sample:
    """One processed sample (1-D token tensors of equal length ``S``).

    ``pixel_values`` is ``(N_patches, C*T*P*P)`` float32 with the rows of all images in order, or
    None for a text-only sample; ``image_grid_thw`` is ``(N_images, 3)`` long or None.
    ``text_chars`` is the length of the rendered conversation without images (for statistics).
    """

    sample_id: str
    input_ids: torch.Tensor
    labels: torch.Tensor
    mm_token_type_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    text_chars: int = 0
    # (N_videos,) float: seconds per temporal patch of each video (temporal_patch_size / sampled fps);
    # videos are visual items like images (rows in pixel_values, grids with t > 1 in image_grid_thw)
    second_per_grid_ts: torch.Tensor | None = None
    # ``(N_frames, n_mels)`` float32: the mel frames of every audio in order, each unpadded; and
    # ``(N_audios, 1)`` long: each audio's frame count (the ``audio_tokens`` layout's meta rows)
    audio_features: torch.Tensor | None = None
    audio_lens: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Sequence length of the sample in LLM tokens (image tokens included)."""
        return int(self.input_ids.numel())

    @property
    def num_patches(self) -> int:
        """Vision-encoder tokens (patches) of all images of the sample; 0 when text-only."""
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.prod(dim=1).sum())

    @property
    def num_images(self) -> int:
        """Number of images of the sample."""
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])

    @property
    def num_image_tokens(self) -> int:
        """LLM positions that hold image embeddings (after the patch merger)."""
        return int((self.mm_token_type_ids == IMAGE).sum())

    @property
    def num_videos(self) -> int:
        """Number of videos of the sample (they are counted in ``num_images``' grid rows too)."""
        return 0 if self.second_per_grid_ts is None else int(self.second_per_grid_ts.numel())

    @property
    def num_video_tokens(self) -> int:
        """LLM positions that hold video embeddings."""
        return int((self.mm_token_type_ids == VIDEO).sum())

    @property
    def num_audios(self) -> int:
        """Number of audios of the sample (a video's own audio track included)."""
        return 0 if self.audio_lens is None else int(self.audio_lens.shape[0])

    @property
    def num_audio_frames(self) -> int:
        """Mel frames of all audios of the sample (the audio encoder's input rows)."""
        return 0 if self.audio_lens is None else int(self.audio_lens.sum())

    @property
    def num_label_tokens(self) -> int:
        """Label tokens after the causal shift (HF convention: the loss drops ``labels[0]``)."""
        return int((self.labels[1:] != IGNORE_INDEX).sum())


@dataclass
class VLBatch:
    """One micro-batch of one LLM data replica (CPU tensors; see docs/INTERFACES.md "Batch").

    ``input_ids``, ``attention_mask``, ``labels``, ``mm_token_type_ids``: ``(B, S)`` long, right-padded.
    ``pixel_values``: ``(N_patches, C*T*P*P)`` float32 of all images in order, or None.
    ``image_grid_thw``: ``(N_images, 3)`` long, or None. ``sample_ids``: one per row.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    mm_token_type_ids: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    sample_ids: list[str] = field(default_factory=list)
    second_per_grid_ts: torch.Tensor | None = None  # (N_videos,) float, videos in item order
    audio_features: torch.Tensor | None = None  # (N_frames, n_mels) float32, audios in order
    audio_lens: torch.Tensor | None = None  # (N_audios, 1) long, mel frames per audio

    @property
    def num_label_tokens(self) -> int:
        """Label tokens of the micro-batch after the causal shift (the runtime's loss normaliser part)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    @property
    def num_patches(self) -> int:
        """Vision-encoder tokens (patches) of the micro-batch."""
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.prod(dim=1).sum())


def collate(samples: list[Sample], *, pad_token_id: int) -> VLBatch:
    """Right-pad ``samples`` to the longest one and concatenate their images in order.

    Memory: one ``(B, S_max)`` copy of each token tensor; the pixel rows are concatenated once.
    """
    if not samples:
        raise ValueError("collate() needs at least one sample")
    longest = max(s.num_tokens for s in samples)
    shape = (len(samples), longest)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    mm_types = torch.zeros(shape, dtype=torch.long)
    for row, s in enumerate(samples):
        n = s.num_tokens
        input_ids[row, :n] = s.input_ids
        attention_mask[row, :n] = 1
        labels[row, :n] = s.labels
        mm_types[row, :n] = s.mm_token_type_ids
    pixels = [s.pixel_values for s in samples if s.pixel_values is not None]
    grids = [s.image_grid_thw for s in samples if s.image_grid_thw is not None]
    seconds = [s.second_per_grid_ts for s in samples if s.second_per_grid_ts is not None]
    audio = [s.audio_features for s in samples if s.audio_features is not None]
    audio_lens = [s.audio_lens for s in samples if s.audio_lens is not None]
    return VLBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        labels=labels,
        mm_token_type_ids=mm_types,
        pixel_values=torch.cat(pixels, dim=0) if pixels else None,
        image_grid_thw=torch.cat(grids, dim=0) if grids else None,
        sample_ids=[s.sample_id for s in samples],
        second_per_grid_ts=torch.cat(seconds) if seconds else None,
        audio_features=torch.cat(audio, dim=0) if audio else None,
        audio_lens=torch.cat(audio_lens, dim=0) if audio_lens else None,
    )


def concat_batches(batches: list[VLBatch], *, pad_token_id: int) -> VLBatch:
    """Every row of ``batches``, in order, as ONE batch right-padded to the longest row; the visual
    items concatenated in the same (row-major) order. For a single-process reference that runs the
    step's whole batch in one call: rows are taken as they are (unpack packed rows first), the pixel
    rows must be tensors (fetch object-store references first).

    Memory: one ``(sum B, S_max)`` copy of each token tensor and one copy of every pixel row.
    """
    if not batches:
        raise ValueError("concat_batches() needs at least one batch")
    longest = max(b.input_ids.shape[1] for b in batches)

    def cat(name: str, pad: int) -> torch.Tensor:
        rows = [getattr(b, name) for b in batches]
        return torch.cat([torch.nn.functional.pad(r, (0, longest - r.shape[1]), value=pad) for r in rows])

    def items(name: str) -> torch.Tensor | None:
        kept = [getattr(b, name) for b in batches if getattr(b, name) is not None]
        return torch.cat(kept, dim=0) if kept else None

    return VLBatch(
        input_ids=cat("input_ids", pad_token_id),
        attention_mask=cat("attention_mask", 0),
        labels=cat("labels", IGNORE_INDEX),
        mm_token_type_ids=cat("mm_token_type_ids", 0),
        pixel_values=items("pixel_values"),
        image_grid_thw=items("image_grid_thw"),
        sample_ids=[i for b in batches for i in b.sample_ids],
        second_per_grid_ts=items("second_per_grid_ts"),
        audio_features=items("audio_features"),
        audio_lens=items("audio_lens"),
    )
