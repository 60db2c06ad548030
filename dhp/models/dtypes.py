"""Model dtype names (``model.dtype``) -> torch dtypes, for every family."""

from __future__ import annotations

import torch

from dhp.errors import ConfigError, ConfigIssue

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; a ConfigError for anything else unknown."""
    if name not in DTYPES:
        raise ConfigError(
            [
                ConfigIssue(
                    "model.dtype", name, f"unknown dtype; known: {sorted(DTYPES)}", "use float32 or bfloat16"
                )
            ]
        )
    return DTYPES[name]
