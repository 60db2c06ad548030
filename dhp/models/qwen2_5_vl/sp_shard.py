"""The vision encoder's SP cut under its historical name: it lives in ``dhp.models.qwen2_5_vision.sp``
(shared with Qwen2.5-Omni, whose encoder has the same window geometry)."""

from __future__ import annotations

from dhp.models.qwen2_5_vision.sp import (
    SPLIT_SIZES_KWARG,
    VisionShard,
    balance_cuts,
    shard_vision_batch,
)

__all__ = ["SPLIT_SIZES_KWARG", "VisionShard", "balance_cuts", "shard_vision_batch"]
