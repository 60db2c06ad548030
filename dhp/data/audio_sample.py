"""A sample's audios -> mel frames, and their placeholder tokens expanded to the encoder's output count.

An audio is decoded to mono at the feature extractor's rate (:mod:`dhp.data.audio`), turned into log-mel
frames by the model family's own feature extractor (transformers' ``WhisperFeatureExtractor`` for the
Qwen omni families), and its one ``<|AUDIO|>`` token in the rendered text becomes as many tokens as the
audio encoder outputs for those frames (``AudioSpec.tokens``), typed ``AUDIO``. The frames of every
audio of a sample are concatenated unpadded, in token order (``Sample.audio_features``), with one frame
count per audio (``Sample.audio_lens``): the ``audio_tokens`` hand-off layout's input and meta rows.

A record with ``use_audio_in_video`` also brings each video's own audio track: decoded from the video
file (:func:`dhp.data.audio.video_audio`; a video without one is ``no_audio_track``), turned into frames
by the same extractor, and laid out with the video's tokens as the family's HF processor writes them
(the family's ``video_with_audio_ids``: ``<|vision_bos|><|audio_bos|>``, the video and audio tokens
interleaved by time, ``<|audio_eos|><|vision_eos|>``). Every audio's frames, files and tracks alike,
are in the order of its tokens: the order the LLM scatters ``audio_embeds`` into the audio positions.

Never truncates: an audio over ``data.max_audio_seconds`` or a sample over ``modules.<encoder>.seq_len``
mel frames is a named bad sample.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dhp.data import bad
from dhp.data.batch import AUDIO, IGNORE_INDEX, IMAGE, TEXT, VIDEO, Sample


@dataclass(frozen=True)
class AudioSpec:
    """How a family turns audio into its encoder's input: the feature extractor (``sampling_rate``,
    ``hop_length``, ``feature_size`` mel bins, callable on a waveform), the encoder's output tokens of
    each audio's frame count, and the limits."""

    extractor: Any
    tokens: Callable[[list[int]], list[int]]
    max_seconds: float
    max_frames: int  # mel frames of one sample at most (the encoder's seq_len); sys.maxsize: none
    max_frames_key: str = "the audio encoder's seq_len"  # the config key of max_frames, for messages
    #: ``(grid=, seconds=, audio_tokens=) -> ids`` of a video interleaved with its own audio track (the
    #: family's ``video_with_audio_ids``; None from it: not laid out); None: records asking are refused
    video_with_audio: Callable[..., list[int] | None] | None = None


def mel_frames(spec: AudioSpec, wave: np.ndarray) -> torch.Tensor:
    """``(frames, n_mels)`` float32 log-mel frames of one mono waveform at the extractor's rate.

    The extractor is called on the waveform zero-padded by two hops and the frames of the waveform kept,
    ``ceil(samples / hop)``: the same values transformers' processor gives inside its 30-s padding (its
    attention mask keeps as many frames), for any length (no 30-s cut).
    """
    fe = spec.extractor
    hop = int(fe.hop_length)
    frames = math.ceil(len(wave) / hop)
    out = fe(
        wave,
        sampling_rate=int(fe.sampling_rate),
        return_tensors="np",
        padding="max_length",
        max_length=(frames + 2) * hop,
        truncation=False,
    )
    feats = np.asarray(out["input_features"])[0, :, :frames]  # (n_mels, frames)
    return torch.from_numpy(np.ascontiguousarray(feats.T)).to(torch.float32)


def with_audio(proc: Any, record: Any, sample: Sample) -> Sample:
    """``sample`` (text, images and videos done) with ``record``'s audios: their frames, their counts,
    and each ``<|AUDIO|>`` token expanded to the encoder's output tokens. With ``use_audio_in_video``,
    each video's own audio track too: decoded from the video file, turned into frames by the same
    extractor, and its tokens interleaved with the video's as the family's processor writes them
    (:func:`interleave_tracks`). The frames of all audios follow their tokens' order. A bad audio, a
    placeholder count that differs from the audio count, or a limit passed is a named bad sample."""
    loc = record.location
    audios = tuple(getattr(record, "audios", ()))
    tracks = tuple(record.videos) if getattr(record, "use_audio_in_video", False) else ()
    if not audios and not tracks:
        return sample
    spec = _spec(proc, loc=loc, tracks=bool(tracks))
    # reason: soundfile loads libsndfile; only a run with audio records pays for it
    from dhp.data.audio import load_audio, video_audio

    rate = int(spec.extractor.sampling_rate)
    waves = [load_audio(p, sampling_rate=rate, loc=loc, max_seconds=spec.max_seconds) for p in audios]
    waves += [video_audio(p, sampling_rate=rate, loc=loc, max_seconds=spec.max_seconds) for p in tracks]
    feats = [mel_frames(spec, w) for w in waves]
    lens = [int(f.shape[0]) for f in feats]
    if sum(lens) > spec.max_frames:
        raise bad.BadSampleError(
            location=loc,
            reason=bad.AUDIO_TOO_LONG,
            detail=f"{sum(lens)} mel frames {lens} > {spec.max_frames_key}={spec.max_frames} (the frames "
            "of one sample the plan sizes the audio encoder for)",
            fix=f"raise {spec.max_frames_key}, or use shorter audio",
        )
    counts = spec.tokens(lens)
    pad = proc.tokens.audio_token_id
    ids, labels, types, starts = _expand_audio(sample, pad, counts[: len(audios)], loc=loc)
    order = list(range(len(audios)))
    if tracks:
        expanded = dataclasses.replace(sample, input_ids=ids, labels=labels, mm_token_type_ids=types)
        ids, labels, types, video_starts = interleave_tracks(
            expanded, spec, counts[len(audios) :], audio_id=pad, merge=proc.merge, loc=loc
        )
        # every audio in token order: a file at its expanded pad run, a track at its video's span
        at = starts + video_starts
        order = sorted(range(len(at)), key=lambda k: at[k])
    if proc.limits.broken(tokens=ids.numel()):
        raise bad.BadSampleError(
            location=loc,
            reason=bad.TEXT_TOO_LONG,
            detail=f"{ids.numel()} tokens ({sum(counts)} audio) > {proc.limits.token_key}={proc.limits.token_seq_len}",
            fix=f"raise {proc.limits.token_key}, or use shorter audio",
        )
    return dataclasses.replace(
        sample,
        input_ids=ids,
        labels=labels,
        mm_token_type_ids=types,
        audio_features=torch.cat([feats[k] for k in order], dim=0),
        audio_lens=torch.tensor([lens[k] for k in order], dtype=torch.long).view(-1, 1),
    )


def _spec(proc: Any, *, loc: str, tracks: bool) -> AudioSpec:
    """The processor's audio spec, or the named refusal of a model without audio (or, for a video's own
    audio track, of a family that does not lay a video out with its audio)."""
    if proc.audio_refusal or proc.audio is None:
        raise bad.BadSampleError(
            location=loc,
            reason=bad.UNSUPPORTED_MODALITY,
            detail=proc.audio_refusal or "the processor was built without audio settings",
            fix="drop the audio records from the dataset (or set use_audio_in_video to false), or train them "
            "with a family that has an audio encoder",
        )
    spec: AudioSpec = proc.audio
    if tracks and spec.video_with_audio is None:
        raise bad.BadSampleError(
            location=loc,
            reason=bad.UNSUPPORTED_MODALITY,
            detail="use_audio_in_video: the processor was built without the family's layout of a video "
            "with its audio track",
            fix="build the processor through dhp.data.source, or set use_audio_in_video to false",
        )
    return spec


def interleave_tracks(
    sample: Sample, spec: AudioSpec, counts: list[int], *, audio_id: int, merge: int, loc: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Every video's token run in ``sample`` replaced by the family's interleaving of the video with its
    audio track (``counts[v]`` tokens for video ``v``): ``(ids, labels, types, starts)``, ``starts[v]``
    the position (in ``sample``) of video ``v``'s run. The new positions have no label; video tokens
    are typed ``VIDEO``, audio tokens ``AUDIO``, the inserted audio start/end tokens ``TEXT``.
    The visual items' runs are found from their grids, in token order (``t*h*w / merge**2`` each)."""
    ids, labels, types = sample.input_ids, sample.labels, sample.mm_token_type_ids
    grids = sample.image_grid_thw.tolist() if sample.image_grid_thw is not None else []
    seconds = sample.second_per_grid_ts.tolist() if sample.second_per_grid_ts is not None else []
    visual = torch.isin(types, torch.tensor([IMAGE, VIDEO])).nonzero().flatten().tolist()
    runs, c = [], 0
    for t, h, w in grids:
        n = t * h * w // merge**2
        if int(types[visual[c]]) == VIDEO:
            runs.append((visual[c], n, (t, h, w)))
        c += n
    if len(runs) != len(counts):
        raise bad.BadSampleError(
            location=loc,
            reason=bad.PLACEHOLDER_MISMATCH,
            detail=f"{len(runs)} video token run(s) for {len(counts)} video audio track(s)",
            fix="give one <video> tag per video, and no literal video special tokens in the text",
        )
    out_ids, out_lab, out_typ, prev = [], [], [], 0
    for (pos, n, grid), k, secs in zip(runs, counts, seconds, strict=True):
        body = spec.video_with_audio(grid=grid, seconds=float(secs), audio_tokens=k)
        if body is None:
            raise bad.BadSampleError(
                location=loc,
                reason=bad.UNSUPPORTED_MODALITY,
                detail="use_audio_in_video: the model family does not lay out a video with its audio track",
                fix="set use_audio_in_video to false, or give the track as its own file in `audios`",
            )
        new = torch.tensor(body, dtype=torch.long)
        kind = torch.full_like(new, TEXT)
        kind[new == ids[pos]] = VIDEO
        kind[new == audio_id] = AUDIO
        out_ids += [ids[prev:pos], new]
        out_lab += [labels[prev:pos], torch.full_like(new, IGNORE_INDEX)]
        out_typ += [types[prev:pos], kind]
        prev = pos + n
    out_ids.append(ids[prev:])
    out_lab.append(labels[prev:])
    out_typ.append(types[prev:])
    return torch.cat(out_ids), torch.cat(out_lab), torch.cat(out_typ), [r[0] for r in runs]


def _expand_audio(
    sample: Sample, pad: int, counts: list[int], *, loc: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Repeat the k-th audio pad token ``counts[k]`` times (no label, type ``AUDIO``); the last item is
    each audio's first position in the new sequence."""
    ids, labels, types = sample.input_ids, sample.labels, sample.mm_token_type_ids
    where = (ids == pad).nonzero().flatten().tolist()
    if len(where) != len(counts):
        raise bad.BadSampleError(
            location=loc,
            reason=bad.PLACEHOLDER_MISMATCH,
            detail=f"rendered text has {len(where)} audio pad tokens for {len(counts)} audio(s)",
            fix="give one <audio> tag per audio file, and no literal audio special tokens in the text",
        )
    out_ids, out_lab, out_typ, starts, prev, grown = [], [], [], [], 0, 0
    for pos, n in zip(where, counts, strict=True):
        starts.append(pos + grown)
        grown += n - 1
        out_ids += [ids[prev:pos], torch.full((n,), pad, dtype=torch.long)]
        out_lab += [labels[prev:pos], torch.full((n,), IGNORE_INDEX, dtype=torch.long)]
        out_typ += [types[prev:pos], torch.full((n,), AUDIO, dtype=torch.long)]
        prev = pos + 1
    out_ids.append(ids[prev:])
    out_lab.append(labels[prev:])
    out_typ.append(types[prev:])
    return torch.cat(out_ids), torch.cat(out_lab), torch.cat(out_typ), starts


def reference_audio_kwargs(batch: Any) -> dict[str, torch.Tensor]:
    """A batch's audios as transformers' omni models take them: ``input_features`` ``(N, n_mels,
    longest)`` zero-padded and ``feature_attention_mask`` ``(N, longest)`` (empty without audio), for
    single-process references."""
    if batch.audio_lens is None:
        return {}
    lens = batch.audio_lens.view(-1).tolist()
    longest = max(lens)
    feats = torch.zeros(len(lens), batch.audio_features.shape[1], longest, dtype=batch.audio_features.dtype)
    mask = torch.zeros(len(lens), longest, dtype=torch.long)
    for i, part in enumerate(batch.audio_features.split(lens)):
        feats[i, :, : part.shape[0]] = part.T
        mask[i, : part.shape[0]] = 1
    return {"input_features": feats, "feature_attention_mask": mask}
