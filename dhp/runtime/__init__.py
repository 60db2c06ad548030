"""Ray runtime: actor groups, worker contracts, the cross-group hand-off and the driver step.

Importing this package loads nothing: ``Trainer`` and ``StepResult`` (``dhp.runtime.driver``) are
imported on first use. A Ray worker process imports only the module its actor class lives in (a
``ModuleWorker`` never loads the driver, the data loader or the planner's renderer).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"StepResult": "dhp.runtime.driver_step", "Trainer": "dhp.runtime.driver"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
