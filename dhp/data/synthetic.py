"""Synthetic fixed-size samples for benchmarks and smoke tests.

Sample ``i`` holds ``images_per_sample`` images of exactly ``patches`` encoder patches each (grid
``(1, h, w)`` with ``h*w == patches``, both multiples of the merge size, as square as possible:
1024 -> 32x32, the grid of a 448 px image) followed by exactly ``text_tokens`` label tokens. Pixel
values and token ids come from a generator seeded by ``(seed, i)``, so any sample can be rebuilt
alone, in any order, on any process. Pixel rows are random normals (benchmarks only; the demo uses
real images): memory is ``patches * C*T*P*P * 4`` bytes per image (308 MiB at 65,536 patches).
"""

from __future__ import annotations

import math
from dataclasses import fields

import torch

from dhp.config.schema import SpecialTokens, SyntheticData, VisionArch
from dhp.config.validate_data_keys import synthetic_sample_tokens
from dhp.data import bad
from dhp.data.batch import AUDIO, IGNORE_INDEX, IMAGE, TEXT, VIDEO, Sample
from dhp.data.processing import Limits
from dhp.errors import ConfigError, ConfigIssue


def synthetic_grid(patches: int, *, merge: int) -> tuple[int, int, int]:
    """The most square ``(1, h, w)`` with ``h*w == patches`` and ``h, w`` multiples of ``merge``."""
    unit = merge * merge
    if patches <= 0 or patches % unit:
        raise ConfigError(
            [
                ConfigIssue(
                    "data.synthetic.patches",
                    patches,
                    f"must be a positive multiple of spatial_merge_size^2 = {unit}",
                    f"use e.g. {max(unit, patches - patches % unit)}",
                )
            ]
        )
    cells = patches // unit
    best = max(d for d in range(1, math.isqrt(cells) + 1) if cells % d == 0)
    return 1, best * merge, (cells // best) * merge


def patches_for_side(side_px: int, *, patch_size: int = 14) -> int:
    """Encoder patches of a ``side_px`` x ``side_px`` image (side a multiple of patch*merge): (side/P)^2."""
    return (side_px // patch_size) ** 2


class SyntheticSource:
    """``num_samples`` deterministic samples (see module docstring); indexable like a dataset."""

    def __init__(
        self,
        *,
        synthetic: SyntheticData,
        vision: VisionArch,
        tokens: SpecialTokens,
        vocab_size: int,
        limits: Limits,
        seed: int,
        audio: tuple[int, int] | None = None,
    ) -> None:
        """``audio``: ``(mel bins, tokens of one audio of audio_frames frames)`` of the model's audio
        encoder; None: the model has none, and no sample holds audio."""
        self.cfg = synthetic
        self.audio = audio if synthetic.audios_per_sample > 0 else None
        self.vision = vision
        self.tokens = tokens
        self.limits = limits
        self.seed = seed
        self.grid = synthetic_grid(synthetic.patches, merge=vision.spatial_merge_size)
        special = {getattr(tokens, f.name) for f in fields(SpecialTokens)}
        self.text_ids = torch.tensor([t for t in range(vocab_size) if t not in special], dtype=torch.long)
        if synthetic.num_samples <= 0 or synthetic.text_tokens <= 0 or synthetic.images_per_sample < 0:
            raise ConfigError(
                [
                    ConfigIssue(
                        "data.synthetic",
                        synthetic,
                        "num_samples and text_tokens must be > 0, images_per_sample >= 0",
                        "fix the counts",
                    )
                ]
            )
        t = vision.temporal_patch_size
        if synthetic.videos_per_sample and (synthetic.video_frames <= 0 or synthetic.video_frames % t):
            raise ConfigError(
                [
                    ConfigIssue(
                        "data.synthetic.video_frames",
                        synthetic.video_frames,
                        f"must be a positive multiple of temporal_patch_size={t}",
                        f"use {max(t, synthetic.video_frames - synthetic.video_frames % t)}",
                    )
                ]
            )

    def __len__(self) -> int:
        return self.cfg.num_samples

    def location(self, index: int) -> str:
        """``"synthetic:<index>"``."""
        return f"synthetic:{index}"

    @property
    def video_patches(self) -> int:
        """Encoder patches of one sample's videos (``video_frames / T`` temporal patches of ``patches``)."""
        return (
            self.cfg.videos_per_sample
            * self.cfg.video_frames
            // self.vision.temporal_patch_size
            * self.cfg.patches
        )

    @property
    def video_tokens(self) -> int:
        """LLM tokens of one synthetic video."""
        frames = self.cfg.video_frames // self.vision.temporal_patch_size
        return frames * self.cfg.patches // self.vision.spatial_merge_size**2

    def text_length(self, gen: torch.Generator) -> int:
        """``text_tokens``, or a draw from ``[text_tokens, text_tokens_max]`` (the sample's generator)."""
        lo, hi = self.cfg.text_tokens, self.cfg.text_tokens_max
        if hi <= lo:
            return lo
        return lo + int(torch.randint(hi - lo + 1, (1,), generator=gen))

    def load(self, index: int) -> Sample:
        """Build sample ``index`` from the seed; raises ``BadSampleError`` if it exceeds the limits."""
        loc = self.location(index)
        n_img, patches = self.cfg.images_per_sample, self.cfg.patches
        merged = patches // self.vision.spatial_merge_size**2
        if n_img * patches + self.video_patches > self.limits.patch_seq_len:
            raise bad.BadSampleError(
                location=loc,
                reason=bad.VISION_TOO_LONG,
                detail=f"{n_img}x{patches} patches > {self.limits.patch_key}={self.limits.patch_seq_len}",
                fix=f"lower data.synthetic.patches/images_per_sample or raise {self.limits.patch_key}",
            )
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n_text = self.text_length(gen)
        total = synthetic_sample_tokens(
            self.cfg,
            spatial_merge_size=self.vision.spatial_merge_size,
            temporal_patch_size=self.vision.temporal_patch_size,
            text_tokens=n_text,
            audio_tokens=self.audio[1] if self.audio else 0,
        )
        if total > self.limits.token_seq_len:
            raise bad.BadSampleError(
                location=loc,
                reason=bad.TEXT_TOO_LONG,
                detail=f"{total} tokens > {self.limits.token_key}={self.limits.token_seq_len}",
                fix=f"lower data.synthetic.text_tokens/patches or raise {self.limits.token_key}",
            )
        t = self.tokens
        image_block = [t.vision_start_token_id] + [t.image_token_id] * merged + [t.vision_end_token_id]
        text = self.text_ids[torch.randint(len(self.text_ids), (n_text,), generator=gen)]
        n_vid, frames = self.cfg.videos_per_sample, self.cfg.video_frames
        video_block = (
            [t.vision_start_token_id] + [t.video_token_id] * self.video_tokens + [t.vision_end_token_id]
        )
        n_aud = self.cfg.audios_per_sample if self.audio else 0
        audio_block = (
            [t.audio_start_token_id]
            + [t.audio_token_id] * (self.audio[1] if self.audio else 0)
            + [t.audio_end_token_id]
        )
        visual = torch.tensor(
            audio_block * n_aud + image_block * n_img + video_block * n_vid, dtype=torch.long
        )
        ids = torch.cat([visual, text])
        types = torch.full_like(ids, TEXT)
        types[: len(visual)][visual == t.image_token_id] = IMAGE
        types[: len(visual)][visual == t.video_token_id] = VIDEO
        if n_aud:
            types[: len(visual)][visual == t.audio_token_id] = AUDIO
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[len(visual) :] = text
        pixel_values = grid = seconds = None
        if n_img or n_vid:
            v = self.vision
            row = v.in_channels * v.temporal_patch_size * v.patch_size**2
            t_grid = frames // v.temporal_patch_size
            n_rows = n_img * patches + n_vid * t_grid * patches
            pixel_values = torch.randn(n_rows, row, generator=gen, dtype=torch.float32)
            _, gh, gw = self.grid
            grid = torch.tensor([self.grid] * n_img + [(t_grid, gh, gw)] * n_vid, dtype=torch.long)
            if n_vid:
                seconds = torch.full((n_vid,), v.temporal_patch_size / self.cfg.video_fps)
        audio = lens = None
        if n_aud:
            frames = self.cfg.audio_frames
            audio = torch.randn(n_aud * frames, self.audio[0], generator=gen, dtype=torch.float32)
            lens = torch.full((n_aud, 1), frames, dtype=torch.long)
        return Sample(
            sample_id=loc,
            input_ids=ids,
            labels=labels,
            mm_token_type_ids=types,
            pixel_values=pixel_values,
            image_grid_thw=grid,
            text_chars=n_text,
            second_per_grid_ts=seconds,
            audio_features=audio,
            audio_lens=lens,
        )
