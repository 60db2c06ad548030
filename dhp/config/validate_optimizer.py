"""Validation of ``train.optimizer``: the AdamW implementation must exist and run on the device."""

from __future__ import annotations

from omegaconf import DictConfig

from dhp.config.constants import FUSED_OPTIMIZER_DEVICES, OPTIMIZER_IMPLS
from dhp.config.issues import Issues


def validate_optimizer(train: DictConfig, *, device: str, issues: Issues) -> None:
    """Add a ConfigIssue when ``train.optimizer.impl`` is unknown or cannot run on ``device``."""
    impl = train.optimizer.impl
    if not issues.one_of(impl, "train.optimizer.impl", OPTIMIZER_IMPLS):
        return
    issues.check(
        impl != "fused" or device in FUSED_OPTIMIZER_DEVICES,
        "train.optimizer.impl",
        impl,
        f"torch has no fused AdamW on cluster.device={device} "
        f"(fused runs on: {', '.join(FUSED_OPTIMIZER_DEVICES)})",
        "set train.optimizer.impl=foreach (or for_loop)",
    )
