"""Tiny Qwen2.5-Omni micro-batches built the way transformers' processor lays them out, for the split
parity tests: the batch as dhp's modules take it, and the same batch as the untouched thinker takes it.

A record is a list of parts: ``("text", n)``, ``("audio", frames)``, ``("image", (h, w))`` (patches),
``("video", (t, h, w), seconds_per_grid)`` or ``("video+audio", (t, h, w), seconds_per_grid, frames)``
(the video interleaved with its own audio track, as ``Qwen2_5OmniProcessor`` writes it with
``use_audio_in_video``: ``<|vision_bos|><|audio_bos|>`` then per 2-second chunk the chunk's video tokens and
its audio tokens, then ``<|audio_eos|><|vision_eos|>``).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen2_5OmniProcessor, Qwen2_5OmniThinkerConfig

from dhp.models.qwen2_5_omni.audio import audio_token_counts
from dhp.ops.cross_entropy import IGNORE_INDEX
from dhp.ops.packed import AUDIO, IMAGE, TEXT, VIDEO

TEXT_IDS = (20, 400)  # random text ids: above the specials, below the tiny audio tokens (433..435)


def _interleaved(cfg: Qwen2_5OmniThinkerConfig, grid: tuple[int, int, int], seconds: float, n_audio: int):
    """The processor's token order of a video with its audio (``replace_video_with_audio_token``)."""
    t, h, w = grid
    merge = cfg.vision_config.spatial_merge_size
    per_t = (h // merge) * (w // merge)
    video_index = np.repeat(np.arange(t), per_t) * seconds * cfg.position_id_per_seconds
    audio_index = np.arange(n_audio)
    per_chunk = int(cfg.position_id_per_seconds * cfg.seconds_per_chunk)
    video_chunks = Qwen2_5OmniProcessor.get_chunked_index(None, video_index, per_chunk)
    audio_chunks = Qwen2_5OmniProcessor.get_chunked_index(None, audio_index, per_chunk)
    ids: list[int] = []
    for j in range(max(len(video_chunks), len(audio_chunks))):
        if j < len(video_chunks):
            ids += [cfg.video_token_id] * (video_chunks[j][1] - video_chunks[j][0])
        if j < len(audio_chunks):
            ids += [cfg.audio_token_id] * (audio_chunks[j][1] - audio_chunks[j][0])
    return ids


def omni_batch(
    cfg: Qwen2_5OmniThinkerConfig, records: list[list[tuple]], *, seeds: list[int]
) -> dict[str, object]:
    """One right-padded micro-batch of ``records`` with every field both sides need (see module doc).
    Record i draws its token ids, pixels and mel frames from ``seeds[i]`` alone, so a record is the same
    in any batch."""
    v = cfg.vision_config
    merge, row_width = v.spatial_merge_size, v.in_channels * v.temporal_patch_size * v.patch_size**2
    mels = cfg.audio_config.num_mel_bins
    rows, visual, audios, flags = [], [], [], []
    for parts, seed in zip(records, seeds, strict=True):
        gen = torch.Generator().manual_seed(seed)
        ids: list[int] = []
        flags.append(any(p[0] == "video+audio" for p in parts))
        for part in parts:
            kind = part[0]
            if kind == "text":
                ids += torch.randint(*TEXT_IDS, (part[1],), generator=gen).tolist()
            elif kind == "audio":
                audios.append(torch.randn(part[1], mels, generator=gen))
                n = audio_token_counts(torch.tensor([part[1]]))[0]
                ids += [cfg.audio_start_token_id, *[cfg.audio_token_id] * n, cfg.audio_end_token_id]
            elif kind == "image":
                grid = (1, *part[1])
                visual.append(
                    ("image", grid, None, torch.randn(int(np.prod(grid)), row_width, generator=gen))
                )
                n = grid[1] * grid[2] // merge**2
                ids += [cfg.vision_start_token_id, *[cfg.image_token_id] * n, cfg.vision_end_token_id]
            elif kind == "video":
                visual.append(
                    ("video", part[1], part[2], torch.randn(int(np.prod(part[1])), row_width, generator=gen))
                )
                n = int(np.prod(part[1])) // merge**2
                ids += [cfg.vision_start_token_id, *[cfg.video_token_id] * n, cfg.vision_end_token_id]
            else:  # video+audio
                _, grid, seconds, frames = part
                visual.append(
                    ("video", grid, seconds, torch.randn(int(np.prod(grid)), row_width, generator=gen))
                )
                audios.append(torch.randn(frames, mels, generator=gen))
                body = _interleaved(cfg, grid, seconds, audio_token_counts(torch.tensor([frames]))[0])
                ids += [cfg.vision_start_token_id, cfg.audio_start_token_id, *body]
                ids += [cfg.audio_end_token_id, cfg.vision_end_token_id]
            ids += torch.randint(*TEXT_IDS, (2,), generator=gen).tolist()
        rows.append(ids)
    seq = max(len(r) for r in rows)
    pad = cfg.text_config.pad_token_id
    input_ids = torch.full((len(rows), seq), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), seq), dtype=torch.long)
    for b, r in enumerate(rows):
        input_ids[b, : len(r)] = torch.tensor(r)
        attention_mask[b, : len(r)] = 1
    types_ = torch.full_like(input_ids, TEXT)
    types_[input_ids == cfg.image_token_id] = IMAGE
    types_[input_ids == cfg.video_token_id] = VIDEO
    types_[input_ids == cfg.audio_token_id] = AUDIO
    specials = (
        cfg.vision_start_token_id,
        cfg.vision_end_token_id,
        cfg.audio_start_token_id,
        cfg.audio_end_token_id,
    )
    labels = input_ids.clone()
    labels[(types_ != TEXT) | (attention_mask == 0) | torch.isin(input_ids, torch.tensor(specials))] = (
        IGNORE_INDEX
    )
    pixels = [p for *_, p in visual]
    grids = torch.tensor([list(g) for _, g, _, _ in visual], dtype=torch.long).reshape(-1, 3)
    is_video = torch.tensor([k == "video" for k, *_ in visual], dtype=torch.bool)
    seconds = torch.tensor([s for k, _, s, _ in visual if k == "video"], dtype=torch.float32)
    lens = torch.tensor([a.shape[0] for a in audios], dtype=torch.long)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "mm_token_type_ids": types_,
        "pixel_values": torch.cat(pixels) if pixels else None,
        "image_grid_thw": grids if pixels else None,
        "second_per_grid_ts": seconds if seconds.numel() else None,
        "audio_features": torch.cat(audios) if audios else None,
        "audio_lens": lens if audios else None,
        "use_audio_in_video": torch.tensor(flags),
        # the HF side: images and videos apart, audio padded with a feature mask
        "hf": _hf_inputs(input_ids, attention_mask, labels, pixels, grids, is_video, seconds, audios),
    }


def _hf_inputs(
    input_ids, attention_mask, labels, pixels, grids, is_video, seconds, audios
) -> dict[str, object]:
    """The keywords ``Qwen2_5OmniThinkerForConditionalGeneration.forward`` takes for the same batch."""
    out: dict[str, object] = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    images = [p for p, vid in zip(pixels, is_video.tolist(), strict=True) if not vid]
    videos = [p for p, vid in zip(pixels, is_video.tolist(), strict=True) if vid]
    if images:
        out["pixel_values"], out["image_grid_thw"] = torch.cat(images), grids[~is_video]
    if videos:
        out["pixel_values_videos"], out["video_grid_thw"] = torch.cat(videos), grids[is_video]
        out["video_second_per_grid"] = seconds
    if audios:
        longest = max(a.shape[0] for a in audios)
        features = torch.zeros(len(audios), audios[0].shape[1], longest)
        mask = torch.zeros(len(audios), longest, dtype=torch.long)
        for i, a in enumerate(audios):
            features[i, :, : a.shape[0]] = a.T
            mask[i, : a.shape[0]] = 1
        out["input_features"], out["feature_attention_mask"] = features, mask
    return out
