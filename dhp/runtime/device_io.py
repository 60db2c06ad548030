"""Moving a rank's inputs onto its device: a producer's input shard, a consumer's video timing.

Shared by the training step's and the evaluation's worker methods (``dhp.runtime.worker``,
``dhp.runtime.eval_worker``). On cpu nothing is copied; on a GPU each tensor is copied once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dhp.data.batch import VLBatch


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


def video_kwargs(batch: VLBatch, device: torch.device) -> dict:
    """``second_per_grid_ts`` for the LLM forward when the micro-batch holds videos (else nothing)."""
    seconds = batch.second_per_grid_ts
    return {} if seconds is None else {"second_per_grid_ts": seconds.to(device)}
