"""The Qwen3 vision encoder, shared by the families built on it (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5).

Not a family (no ``family.py``): the pieces a family composes for its ``vision`` module. ``arch.py``
and ``config.py`` are torch-free (the planner reads them); ``modules.py`` (the module wrapper, ``K``
DeepStack levels, ``K = 0`` allowed), ``sp.py`` (the driver-side Ulysses cut) and ``tp.py`` (the TP
styles and the encoder's ``ModuleParallelPlan``) load torch. Importing the package loads nothing heavy.
"""

from __future__ import annotations

from dhp.models.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "VisionModule": "dhp.models.qwen3_vision.modules",
        "Qwen3VisionShard": "dhp.models.qwen3_vision.sp",
        "shard_images": "dhp.models.qwen3_vision.sp",
        "vision_parallel_plan": "dhp.models.qwen3_vision.tp",
        "vision_tp_plan": "dhp.models.qwen3_vision.tp",
    },
)
