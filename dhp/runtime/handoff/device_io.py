"""A rank's inputs on its device and the tags its hand-off payloads carry: a producer's input shard,
the loss module's forward keywords of a micro-batch, a micro-batch's hand-off tag.

Shared by the training step's and the evaluation's worker methods (``dhp.runtime.loop.worker``,
``dhp.runtime.loop.eval_worker``). On cpu nothing is copied; on a GPU each tensor is copied once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dhp.data.batch import VLBatch

#: hand-off tags of a pass without backward (the step-statistics pass, an evaluation) start here
#: (a micro-batch's own tag is its index)
STATISTICS_TAG = 1 << 20


def shard_to(shard: Any, device: torch.device) -> Any:
    """The shard with its tensors on ``device`` (a no-op on cpu)."""
    if device.type == "cpu":
        return shard

    return dataclasses.replace(
        shard,
        **{
            f.name: getattr(shard, f.name).to(device)
            for f in dataclasses.fields(shard)
            if isinstance(getattr(shard, f.name), torch.Tensor)
        },
    )


def hand_off_tag(micro_batch: int, backward: bool) -> int:
    """The hand-off tag of a micro-batch's rows: its index, or apart from every index in a pass
    without backward (``backward=False``: the step-statistics pass, an evaluation), so the payloads
    of two passes never pair up."""
    return micro_batch if backward else STATISTICS_TAG + micro_batch


def batch_kwargs(batch: VLBatch, device: torch.device) -> dict[str, Any]:
    """The loss module's forward keywords of a micro-batch (everything but the hand-off edges)."""
    return {
        "input_ids": batch.input_ids.to(device),
        "attention_mask": batch.attention_mask.to(device),
        "labels": batch.labels.to(device),
        "mm_token_type_ids": batch.mm_token_type_ids.to(device),
        "image_grid_thw": None if batch.image_grid_thw is None else batch.image_grid_thw.to(device),
        "sample_ids": batch.sample_ids,
        **video_kwargs(batch, device),
        **audio_kwargs(batch, device),
    }


def audio_kwargs(batch: VLBatch, device: torch.device) -> dict:
    """``audio_lens`` (mel frames per audio, the LLM's audio-time positions) when the micro-batch
    holds audios (else nothing: a model without an audio encoder never sees the keyword)."""
    lens = batch.audio_lens
    return {} if lens is None else {"audio_lens": lens.to(device)}


def video_kwargs(batch: VLBatch, device: torch.device) -> dict:
    """``second_per_grid_ts`` for the LLM forward when the micro-batch holds videos (else nothing)."""
    seconds = batch.second_per_grid_ts
    return {} if seconds is None else {"second_per_grid_ts": seconds.to(device)}
