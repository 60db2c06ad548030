"""A video interleaved with its own audio track (``use_audio_in_video``), as Qwen2.5-Omni lays it out.

``Qwen2_5OmniProcessor`` cuts both streams into chunks of ``position_id_per_seconds * seconds_per_chunk``
TMRoPE positions: a video token sits at its temporal grid's start time (``t * seconds per grid *
position_id_per_seconds``), an audio token at its index (one position each); chunk ``j`` writes its
video tokens, then its audio tokens. Pure: lists of ints, no tensors are built but the flags below.
"""

from __future__ import annotations


def chunk_sizes(positions: list[float], per_chunk: int) -> list[int]:
    """The sizes of the runs of ``positions`` (non-decreasing) that fall in ``[j * per_chunk, (j + 1) *
    per_chunk)``, chunk after chunk, as ``Qwen2_5OmniProcessor.get_chunked_index`` cuts them: a chunk
    closes at the first position at or past its end (so one beyond a gap closes one chunk at a time),
    and the last run is always written (an empty list gives ``[0]``)."""
    sizes, start, chunk = [], 0, 1
    for i, p in enumerate(positions):
        if p >= chunk * per_chunk:
            sizes.append(i - start)
            start, chunk = i, chunk + 1
    sizes.append(len(positions) - start)
    return sizes


def interleaved_ids(
    *,
    grid: tuple[int, int, int],
    merge: int,
    seconds: float,
    audio_tokens: int,
    position_id_per_seconds: float,
    seconds_per_chunk: float,
    ids: tuple[int, int, int, int],
) -> list[int]:
    """``audio_start, <chunk 0 video, chunk 0 audio, chunk 1 video, ...>, audio_end`` of one video with
    ``grid`` ``(t, h, w)`` patches, ``seconds`` per temporal grid, and its track's ``audio_tokens``;
    ``ids`` = (video, audio, audio_start, audio_end) token ids."""
    video_id, audio_id, start_id, end_id = ids
    t, h, w = grid
    per_grid = (h // merge) * (w // merge)
    per_chunk = int(position_id_per_seconds * seconds_per_chunk)
    times = [k * seconds * position_id_per_seconds for k in range(t) for _ in range(per_grid)]
    video = chunk_sizes(times, per_chunk)
    audio = chunk_sizes(list(range(audio_tokens)), per_chunk)
    out = [start_id]
    for j in range(max(len(video), len(audio))):
        if j < len(video):
            out += [video_id] * video[j]
        if j < len(audio):
            out += [audio_id] * audio[j]
    return [*out, end_id]
