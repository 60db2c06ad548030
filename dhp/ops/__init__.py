"""Small numerical ops shared by the model families, the parallel strategies and the verify reference.

This package imports only torch (and torch.distributed for an optional process group), never
``dhp.models`` or ``dhp.parallel``, so both sides can use the same loss.
"""

from dhp.ops.cross_entropy import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    IGNORE_INDEX,
    chunked_ce_sum,
    resolve_chunk_tokens,
    shifted_ce_sum,
)

__all__ = [
    "DEFAULT_LOSS_CHUNK_TOKENS",
    "IGNORE_INDEX",
    "chunked_ce_sum",
    "resolve_chunk_tokens",
    "shifted_ce_sum",
]
