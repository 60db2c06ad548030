"""The Qwen2.5-VL-style vision encoder, shared by the families built on it (Qwen2.5-VL, Qwen2.5-Omni).

Not a family (no ``family.py``): the pieces a family composes for its ``vision`` module. ``arch.py`` is
torch-free (the planner reads it); ``modules.py`` (the module wrapper), ``sp.py`` (the driver-side
window-aligned Ulysses cut) and ``tp.py`` (the TP styles and the encoder's ``ModuleParallelPlan``) load
torch. Importing the package loads nothing heavy.
"""

from __future__ import annotations

from dhp.models.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "VisionModule": "dhp.models.qwen2_5_vision.modules",
        "VisionShard": "dhp.models.qwen2_5_vision.sp",
        "shard_vision_batch": "dhp.models.qwen2_5_vision.sp",
        "vision_parallel_plan": "dhp.models.qwen2_5_vision.tp",
        "vision_tp_plan": "dhp.models.qwen2_5_vision.tp",
    },
)
