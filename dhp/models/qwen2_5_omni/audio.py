"""Qwen2.5-Omni's audio encoder as a module, and its SP cut (driver side, pure).

The encoder (transformers' ``Qwen2_5OmniAudioEncoder``, unmodified) cuts each audio's mel frames into
chunks of ``2 * n_window`` frames (the last one shorter) and treats every chunk alone: both convs run
per (zero-padded) chunk, the sinusoidal position table restarts at 0 in each chunk, and attention never
leaves a chunk. Only the final stride-2 average pool spans a whole audio, pairing rows (2k, 2k+1) of
the audio's post-conv rows; a full chunk has ``n_window`` of them, so with ``n_window`` even no pair
straddles two chunks. Hence any run of whole chunks of one audio, encoded as an audio of its own,
gives exactly that run's rows of the whole encoder's output.

:func:`shard_audio` uses this for SP: it cuts the micro-batch's chunk sequence (audio after audio) into
``sp_size`` contiguous runs balanced by frames; a rank encodes its runs alone and its output rows are a
contiguous slice of the whole output (``token_index``). No collective, no extra memory: each rank holds
only its frames' activations. Parameter gradients are partial sums over the rank's rows: the SP group
sums them (as for the vision encoder's Ulysses SP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dhp.errors import ConfigError, ConfigIssue, DataError
from dhp.models.qwen2_5_vision.sp import balance_cuts


def audio_token_counts(audio_lens: torch.Tensor) -> list[int]:
    """LLM tokens per audio of ``audio_lens`` mel frames: the stride-2 conv then the stride-2 pool
    (transformers' ``_get_feat_extract_output_lengths``): ``((L - 1) // 2 + 1 - 2) // 2 + 1``."""
    after_conv = (audio_lens.reshape(-1).to(torch.long) - 1) // 2 + 1
    return [int(n) for n in ((after_conv - 2) // 2 + 1).tolist()]


def check_audio_inputs(input_features: torch.Tensor, audio_lens: torch.Tensor, *, num_mel_bins: int) -> None:
    """DataError unless ``input_features`` is ``(sum(audio_lens), num_mel_bins)`` and every length >= 1."""
    if input_features.ndim != 2 or input_features.shape[1] != num_mel_bins:
        raise DataError(
            f"audio input_features has shape {tuple(input_features.shape)}; the encoder expects "
            f"(N_frames, {num_mel_bins}) mel frames, every audio's unpadded frames concatenated. Fix: "
            f"build them with the model's WhisperFeatureExtractor (feature_size={num_mel_bins})."
        )
    lens = audio_lens.reshape(-1)
    if lens.numel() and int(lens.min()) < 1:
        raise DataError(f"audio_lens {lens.tolist()} holds an audio of 0 frames. Fix: drop empty audios.")
    if int(lens.sum()) != input_features.shape[0]:
        raise DataError(
            f"audio input_features has {input_features.shape[0]} frames but audio_lens {lens.tolist()} sums "
            f"to {int(lens.sum())}. Fix: pass each audio's unpadded frame count, in order."
        )


class AudioModule(nn.Module):
    """The audio encoder: mel frames -> LLM-width audio embeddings (``proj`` output), audio after audio.

    Placement: one actor group. Memory is dominated by activations (post-conv rows x hidden per block);
    an SP rank holds only its chunks'.
    """

    def __init__(self, audio_tower: nn.Module) -> None:
        super().__init__()
        self.audio_tower = audio_tower

    def forward(self, input_features: torch.Tensor, audio_lens: torch.Tensor) -> dict[str, torch.Tensor]:
        """``(N_frames, n_mels)`` frames of every audio concatenated, ``audio_lens`` (N,) frames per audio
        -> ``{"audio_embeds": (sum of audio_token_counts, out_width)}`` in audio order.

        An :class:`AudioShard` passes its runs of whole chunks as audios of their own; a shard without
        frames returns ``(0, out_width)``, still connected to the parameters (every block runs, on one
        blank row, so FSDP's per-block gathers meet every rank).
        """
        tower = self.audio_tower
        check_audio_inputs(input_features, audio_lens, num_mel_bins=tower.num_mel_bins)
        lens = audio_lens.reshape(-1).to(device=input_features.device, dtype=torch.long)
        features = input_features.to(tower.conv1.weight.dtype)
        if lens.numel() == 0:
            return {"audio_embeds": self._no_rows(features)}
        out = tower(features.T, feature_lens=lens, aftercnn_lens=(lens - 1) // 2 + 1).last_hidden_state
        return {"audio_embeds": out}

    def _no_rows(self, features: torch.Tensor) -> torch.Tensor:
        """Zero frames: the encoder on one blank 4-frame audio (one row), none of its rows kept:
        ``(0, out_width)``, still connected to every parameter (zero gradients)."""
        blank = features.new_zeros(self.audio_tower.num_mel_bins, 4)
        lens = torch.tensor([4], device=features.device)
        return self.audio_tower(
            blank, feature_lens=lens, aftercnn_lens=(lens - 1) // 2 + 1
        ).last_hidden_state[:0]


@dataclass(frozen=True)
class AudioShard:
    """One SP rank's part of a micro-batch's audio (a :class:`~dhp.models.family.ProducerShard`).

    ``input_features``: this rank's frames (its runs of whole chunks, in order); ``audio_lens``: frames
    per run (each run is encoded as an audio of its own); ``token_index``: the ascending rows of the whole
    encoder's output this rank produces; ``num_tokens``: rows of the whole output.
    """

    rank: int
    sp_size: int
    input_features: torch.Tensor
    audio_lens: torch.Tensor
    token_index: torch.Tensor
    num_tokens: int

    @property
    def num_patches(self) -> int:
        """Mel frames on this rank."""
        return int(self.input_features.shape[0])

    def forward_kwargs(self) -> dict[str, torch.Tensor]:
        """``AudioModule.forward``'s keywords: ``input_features`` and ``audio_lens``."""
        return {"input_features": self.input_features, "audio_lens": self.audio_lens}


def shard_audio(rows: torch.Tensor, lens: torch.Tensor, *, sp_size: int, n_window: int) -> list[AudioShard]:
    """Cut one micro-batch's mel frames (``rows`` (N_frames, n_mels), ``lens`` (N,) frames per audio)
    over ``sp_size`` ranks on chunk boundaries (``2 * n_window`` frames), balanced by frames.

    Every chunk goes whole to one rank; runs are contiguous in audio order, so rank r's output rows are
    the slice ``token_index`` of the whole encoder's. ConfigError for ``sp_size < 1`` or an odd
    ``n_window`` with ``sp_size > 1`` (a pool pair would straddle two chunks); DataError for bad lengths.
    """
    if sp_size < 1:
        raise ConfigError(
            [ConfigIssue("modules.audio.parallel.sp", sp_size, "must be >= 1", "set sp to 1 or more")]
        )
    if sp_size > 1 and n_window % 2:
        raise ConfigError(
            [
                ConfigIssue(
                    "modules.audio.parallel.sp",
                    sp_size,
                    f"needs an even model.audio.n_window (got {n_window}): a chunk then has an even number "
                    "of post-conv rows, so the encoder's stride-2 pool never pairs rows of two chunks",
                    "set modules.audio.parallel.sp to 1 (or use a checkpoint whose n_window is even)",
                )
            ]
        )
    lens = lens.reshape(-1).to(device="cpu", dtype=torch.long)
    if lens.numel() == 0 or int(lens.min()) < 1 or int(lens.sum()) != rows.shape[0]:
        raise DataError(
            f"shard_audio: audio_lens {lens.tolist()} must be >= 1 each and sum to the {rows.shape[0]} frame "
            "rows. Fix: skip the audio forward for micro-batches without audio; pass unpadded frame counts."
        )
    chunk = 2 * n_window
    # chunks in audio order: (audio, frames)
    chunks = [
        (a, min(chunk, int(n) - c)) for a, n in enumerate(lens.tolist()) for c in range(0, int(n), chunk)
    ]
    cuts = balance_cuts([f for _, f in chunks], sp_size)
    per_audio = audio_token_counts(lens)
    num_tokens = sum(per_audio)
    frame_start, token_start = _chunk_offsets(chunks, lens.tolist(), chunk)
    shards = []
    for rank in range(sp_size):
        lo, hi = cuts[rank], cuts[rank + 1]
        runs: list[int] = []  # frames per run of one audio's chunks
        for k in range(lo, hi):
            if k > lo and chunks[k][0] == chunks[k - 1][0]:
                runs[-1] += chunks[k][1]
            else:
                runs.append(chunks[k][1])
        f_lo = frame_start[lo] if lo < len(chunks) else rows.shape[0]
        f_hi = frame_start[hi] if hi < len(chunks) else rows.shape[0]
        t_lo = token_start[lo] if lo < len(chunks) else num_tokens
        t_hi = token_start[hi] if hi < len(chunks) else num_tokens
        shards.append(
            AudioShard(
                rank=rank,
                sp_size=sp_size,
                input_features=rows[f_lo:f_hi],
                audio_lens=torch.tensor(runs, dtype=torch.long),
                token_index=torch.arange(t_lo, t_hi),
                num_tokens=num_tokens,
            )
        )
    return shards


def _chunk_offsets(chunks: list[tuple[int, int]], lens: list[int], chunk: int) -> tuple[list[int], list[int]]:
    """First frame and first output row of every chunk in the whole micro-batch. A chunk's rows: half
    its post-conv rows (``n_window / 2`` for a full one); the last chunk of an audio takes the rest of
    the audio's rows (its post-conv rows' pairs)."""
    frame_start, token_start = [], []
    frames = tokens = 0
    for k, (audio, n) in enumerate(chunks):
        frame_start.append(frames)
        token_start.append(tokens)
        frames += n
        last = k + 1 == len(chunks) or chunks[k + 1][0] != audio
        tokens += ((n - 1) // 2 + 1) // 2 if last else (chunk // 2) // 2
    return frame_start, token_start
