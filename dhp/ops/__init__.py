"""Small numerical ops shared by the model families, the parallel strategies and the verify reference.

This package imports only torch (and torch.distributed for an optional process group), never
``dhp.models`` or ``dhp.parallel``, so both sides can use the same loss. Importing the package itself
loads no torch (the names below resolve on first use), so the torch-free planner can import the
torch-free ``dhp.ops.linear_attn`` (the linear-attention kernel name).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "DEFAULT_LOSS_CHUNK_TOKENS": "dhp.ops.cross_entropy",
    "IGNORE_INDEX": "dhp.ops.cross_entropy",
    "chunked_ce_sum": "dhp.ops.cross_entropy",
    "resolve_chunk_tokens": "dhp.ops.cross_entropy",
    "shifted_ce_sum": "dhp.ops.cross_entropy",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dhp.ops' has no attribute {name!r}")


__all__ = [
    "DEFAULT_LOSS_CHUNK_TOKENS",
    "IGNORE_INDEX",
    "chunked_ce_sum",
    "resolve_chunk_tokens",
    "shifted_ce_sum",
]
