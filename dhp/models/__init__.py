"""Model families as module graphs (see ``family.py``, ``registry.py``); no parallelism code lives here.

Importing ``dhp.models`` loads nothing heavy: ``registry`` and each family's ``arch.py`` are
torch-free (the planner uses them); the names below are imported on first use. A family's own
classes are reached through ``get_family(name)`` or its package, never under a generic name here.
"""

from __future__ import annotations

from dhp.models.lazy import lazy_exports
from dhp.models.registry import family_names, get_arch, get_family, register_family

_LAZY = {
    "HandOff": "dhp.models.family",
    "LLMOutput": "dhp.models.family",
    "ModelFamily": "dhp.models.family",
    "StepStatistics": "dhp.models.family",
    "TINY_TOKENS": "dhp.models.tokens",
    "LoadReport": "dhp.models.loading",
    "build_and_load": "dhp.models.loading",
    "checkpoint_index": "dhp.models.loading",
    "load_module_weights": "dhp.models.loading",
    "make_tiny_checkpoint": "dhp.models.tiny",
}

__getattr__, _names = lazy_exports(__name__, _LAZY)
__all__ = ["family_names", "get_arch", "get_family", "register_family", *_names]
