"""Model FLOPs per step (PaLM appendix B formula), counting every module of the run.

Per token, training = 6 * N (matmul params) + 12 * h * (the blocks' attention spans); forward only
(a frozen module) = a third. The formula lives once, on the family's typed architecture
(``dhp.models.arch.palm_flops``): the planner's predicted MFU and this measured one are the same
count. Embedding tables do not count (lookups, not matmuls); lm_head and the merger do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dhp.models.arch import model_flops, palm_flops
from dhp.models.registry import get_arch

__all__ = ["model_flops_per_step", "palm_flops"]


def model_flops_per_step(
    model: Any, *, image_patches: list[int], seq_lens: list[int], frozen: Mapping[str, bool]
) -> float:
    """FLOPs of one step of ``model`` (a schema model block) over the modules in ``frozen``."""
    arch = get_arch(model.family).architecture(model)
    return model_flops(arch, images=image_patches, seq_lens=seq_lens, frozen=frozen)
