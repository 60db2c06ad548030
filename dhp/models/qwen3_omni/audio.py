"""Qwen3-Omni's audio encoder as a module, and its SP cut (driver side, pure).

The encoder (transformers' ``Qwen3OmniMoeAudioEncoder``, unmodified) cuts each audio's mel frames into
chunks of ``2 * n_window`` frames (the last one shorter), zero-pads every chunk of the call to the
call's longest chunk, and runs three stride-2 Conv2d per chunk; the sinusoidal position table restarts
at 0 in each chunk. Attention then runs over *windows* of ``ratio = n_window_infer // (2 * n_window)``
consecutive chunks of one audio (``get_audio_cu_seqlens``: ``ratio * rows(longest chunk)`` rows from
each audio's start, the last window shorter): a window, not a chunk, is the unit attention never
leaves.

Two facts of that code fix the exact SP cut (:func:`shard_audio`):

- a run of whole attention windows of one audio, encoded as an audio of its own, gives exactly that
  run's rows of the whole encoder's output, *provided* its chunks are zero-padded to the same length
  as in the whole call: the padding is not inert (the first conv turns zero frames into
  ``gelu(bias)``, which the next conv reads at a short chunk's last position), and the window length
  in rows is ``ratio`` times the post-conv length of the padded chunk. So every shard carries the
  micro-batch's longest chunk (``chunk_frames``) and :class:`AudioModule` pads to it;
- a cut inside a window would split an attention: it would need a collective. A cut on window
  boundaries needs none.

So rank r encodes a contiguous run of whole windows (audio after audio, balanced by frames); its output
rows are the contiguous slice ``token_index`` of the whole output. Parameter gradients are partial sums
over the rank's rows: the SP group sums them.

Only ``n_window`` in 49..52 builds transformers' model: its ``_get_feat_extract_output_lengths``
counts 13 rows per full chunk (the convs' count for 100 frames); :func:`check_audio_geometry` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dhp.errors import ConfigError, ConfigIssue, DataError

#: output rows of one full chunk in transformers' ``_get_feat_extract_output_lengths`` (hard-coded)
HF_ROWS_PER_CHUNK = 13


def conv_rows(frames: torch.Tensor | int) -> torch.Tensor | int:
    """Rows after the three stride-2 Conv2d (kernel 3, padding 1) of ``frames`` mel frames."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1
    return frames


def check_audio_geometry(*, n_window: int, n_window_infer: int, where: str = "model.audio") -> None:
    """ConfigError unless ``n_window`` gives 13 rows per full chunk (what transformers' length formula
    assumes) and an attention window holds at least one chunk."""
    issues = []
    if conv_rows(2 * n_window) != HF_ROWS_PER_CHUNK:
        issues.append(
            ConfigIssue(
                f"{where}.n_window",
                n_window,
                f"transformers' Qwen3-Omni audio encoder counts {HF_ROWS_PER_CHUNK} rows per chunk of "
                f"2 * n_window frames; n_window={n_window} gives {conv_rows(2 * n_window)}",
                "use the published 50 (49..52 are the only values the encoder builds correctly)",
            )
        )
    if n_window_infer < 2 * n_window:
        issues.append(
            ConfigIssue(
                f"{where}.extra.n_window_infer",
                n_window_infer,
                f"an attention window must hold at least one chunk of 2 * n_window = {2 * n_window} frames",
                "use the published 800",
            )
        )
    if issues:
        raise ConfigError(issues)


def audio_rows(frames: torch.Tensor, *, n_window: int) -> torch.Tensor:
    """Output rows (= LLM audio tokens) per audio of ``frames`` mel frames: transformers'
    ``_get_feat_extract_output_lengths`` (full chunks of 13 rows, then the tail chunk's convs)."""
    chunk = 2 * n_window
    frames = frames.to(torch.long)
    return conv_rows(frames % chunk) + (frames // chunk) * HF_ROWS_PER_CHUNK


def audio_token_counts(audio_lens: torch.Tensor, *, n_window: int) -> list[int]:
    """LLM tokens per audio of ``audio_lens`` mel frames (:func:`audio_rows`)."""
    return [int(n) for n in audio_rows(audio_lens.reshape(-1), n_window=n_window).tolist()]


def window_frames(*, n_window: int, n_window_infer: int) -> int:
    """Mel frames of one attention window: ``n_window_infer // (2 * n_window)`` whole chunks."""
    chunk = 2 * n_window
    return (n_window_infer // chunk) * chunk


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


def _chunk_lengths(lens: torch.Tensor, chunk: int) -> torch.Tensor:
    """Frames of every chunk, audio after audio (``chunk_and_pad_features``' rule)."""
    out = []
    for n in lens.tolist():
        out += [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    return torch.tensor(out, dtype=torch.long, device=lens.device)


class AudioModule(nn.Module):
    """The audio encoder: mel frames -> LLM-width audio embeddings (``proj2`` output), audio after audio.

    Placement: one actor group. Memory is dominated by activations (post-conv rows x hidden per block);
    an SP rank holds only its windows'.
    """

    def __init__(self, audio_tower: nn.Module) -> None:
        super().__init__()
        self.audio_tower = audio_tower

    def forward(
        self,
        input_features: torch.Tensor,
        audio_lens: torch.Tensor,
        chunk_frames: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """``(N_frames, n_mels)`` frames of every audio concatenated, ``audio_lens`` (N,) or (N, 1) frames
        per audio -> ``{"audio_embeds": (sum of audio_token_counts, out_width)}`` in audio order.

        ``chunk_frames`` (one number): the length every chunk is zero-padded to, the whole micro-batch's
        longest chunk (an :class:`AudioShard` passes it); None: this call's longest chunk, as transformers'
        encoder pads. A call without frames returns ``(0, out_width)``, still connected to the parameters
        (every block runs on one blank chunk, so FSDP's per-block gathers meet every rank).
        """
        tower = self.audio_tower
        check_audio_inputs(input_features, audio_lens, num_mel_bins=tower.num_mel_bins)
        features = input_features.to(tower.conv2d1.weight.dtype)
        lens = audio_lens.reshape(-1).to(device=features.device, dtype=torch.long)
        if lens.numel() == 0:
            blank = features.new_zeros(2 * tower.n_window, tower.num_mel_bins)
            return {"audio_embeds": self._encode(blank, lens.new_tensor([blank.shape[0]]), None)[:0]}
        return {"audio_embeds": self._encode(features, lens, chunk_frames)}

    def _encode(
        self, features: torch.Tensor, lens: torch.Tensor, chunk_frames: torch.Tensor | None
    ) -> torch.Tensor:
        """transformers' encoder forward with its chunking precomputed at the padded length ``pad``
        (what its own helpers compute when ``pad`` is the call's longest chunk)."""
        tower = self.audio_tower
        chunk = 2 * tower.n_window
        chunk_lengths = _chunk_lengths(lens, chunk)
        longest = int(chunk_lengths.max())
        pad = longest if chunk_frames is None else int(torch.as_tensor(chunk_frames).reshape(-1)[0])
        if not longest <= pad <= chunk:
            raise DataError(
                f"audio chunk_frames {pad} must lie in [{longest}, {chunk}] (this call's longest chunk, one "
                "full chunk). Fix: pass the micro-batch's longest chunk, as shard_audio does."
            )
        pieces = features.split(chunk_lengths.tolist(), dim=0)
        padded = torch.stack([F.pad(p, (0, 0, 0, pad - p.shape[0])) for p in pieces]).transpose(1, 2)
        width = conv_rows(pad)  # post-conv rows of one padded chunk
        rows = conv_rows(chunk_lengths)
        valid = (torch.arange(width, device=lens.device) < rows.unsqueeze(1)).flatten().nonzero().squeeze(-1)
        window = width * (tower.n_window_infer // chunk)
        cu = [0]
        for n in audio_rows(lens, n_window=tower.n_window).tolist():
            cu += [window] * (n // window) + ([n % window] if n % window else [])
        cu_seqlens = torch.tensor(cu, device=lens.device).cumsum(-1, dtype=torch.int32)
        return tower(
            features.T,
            feature_lens=lens,
            padded_feature=padded,
            chunk_lengths=chunk_lengths,
            valid_indices=valid,
            cu_seqlens=cu_seqlens,
        ).last_hidden_state


@dataclass(frozen=True)
class AudioShard:
    """One SP rank's part of a micro-batch's audio (a :class:`~dhp.models.family.ProducerShard`).

    ``input_features``: this rank's frames (its runs of whole attention windows, in order);
    ``audio_lens``: frames per run (each run is encoded as an audio of its own); ``chunk_frames``: the
    micro-batch's longest chunk, the padded length of every chunk; ``token_index``: the ascending rows of
    the whole encoder's output this rank produces; ``num_tokens``: rows of the whole output.
    """

    rank: int
    sp_size: int
    input_features: torch.Tensor
    audio_lens: torch.Tensor
    chunk_frames: torch.Tensor
    token_index: torch.Tensor
    num_tokens: int

    @property
    def num_patches(self) -> int:
        """Mel frames on this rank."""
        return int(self.input_features.shape[0])

    def forward_kwargs(self) -> dict[str, torch.Tensor]:
        """``AudioModule.forward``'s keywords: ``input_features``, ``audio_lens``, ``chunk_frames``."""
        return {
            "input_features": self.input_features,
            "audio_lens": self.audio_lens,
            "chunk_frames": self.chunk_frames,
        }


def balanced_cuts(weights: list[int], parts: int) -> list[int]:
    """``parts + 1`` ascending cut points into ``weights`` (0 and ``len`` at the ends): cut k at the
    prefix whose sum is nearest ``k * total / parts`` (on a tie, the later one: empty ranks come last)."""
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    total, cuts = prefix[-1], [0]
    for k in range(1, parts):
        target = k * total / parts
        best = min(range(cuts[-1], len(prefix)), key=lambda i: (abs(prefix[i] - target), -i))
        cuts.append(best)
    return [*cuts, len(weights)]


def shard_audio(
    rows: torch.Tensor, lens: torch.Tensor, *, sp_size: int, n_window: int, n_window_infer: int
) -> list[AudioShard]:
    """Cut one micro-batch's mel frames (``rows`` (N_frames, n_mels), ``lens`` (N,) frames per audio)
    over ``sp_size`` ranks on attention-window boundaries (:func:`window_frames` frames from each
    audio's start), balanced by frames; every shard pads its chunks to the micro-batch's longest chunk.

    Every window goes whole to one rank; runs are contiguous in audio order, so rank r's output rows are
    the slice ``token_index`` of the whole encoder's. ConfigError for ``sp_size < 1`` or a geometry
    transformers' encoder does not build; DataError for bad lengths.
    """
    if sp_size < 1:
        raise ConfigError(
            [ConfigIssue("modules.audio.parallel.sp", sp_size, "must be >= 1", "set sp to 1 or more")]
        )
    check_audio_geometry(n_window=n_window, n_window_infer=n_window_infer)
    lens = lens.reshape(-1).to(device="cpu", dtype=torch.long)
    if lens.numel() == 0 or int(lens.min()) < 1 or int(lens.sum()) != rows.shape[0]:
        raise DataError(
            f"shard_audio: audio_lens {lens.tolist()} must be >= 1 each and sum to the {rows.shape[0]} frame "
            "rows. Fix: skip the audio forward for micro-batches without audio; pass unpadded frame counts."
        )
    unit = window_frames(n_window=n_window, n_window_infer=n_window_infer)
    windows = [(a, min(unit, n - s)) for a, n in enumerate(lens.tolist()) for s in range(0, n, unit)]
    cuts = balanced_cuts([f for _, f in windows], sp_size)
    longest = int(_chunk_lengths(lens, 2 * n_window).max())
    starts = [0]  # first frame and first output row of every window, and the end
    tokens = [0]
    for _, f in windows:
        starts.append(starts[-1] + f)
        tokens.append(tokens[-1] + int(audio_rows(torch.tensor(f), n_window=n_window)))
    shards = []
    for rank in range(sp_size):
        lo, hi = cuts[rank], cuts[rank + 1]
        runs: list[int] = []  # frames per run of one audio's windows
        for k in range(lo, hi):
            if k > lo and windows[k][0] == windows[k - 1][0]:
                runs[-1] += windows[k][1]
            else:
                runs.append(windows[k][1])
        shards.append(
            AudioShard(
                rank=rank,
                sp_size=sp_size,
                input_features=rows[starts[lo] : starts[hi]],
                audio_lens=torch.tensor(runs, dtype=torch.long),
                chunk_frames=torch.tensor([longest]),
                token_index=torch.arange(tokens[lo], tokens[hi]),
                num_tokens=tokens[-1],
            )
        )
    return shards
