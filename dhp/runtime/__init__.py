"""Ray runtime: actor groups, worker contracts, the cross-group hand-off and the driver step, in rooms.

The rooms, each a subpackage whose ``__init__`` says what it owns, from the top (a room imports
only the rooms below it; ``lint-imports`` checks it, contract ``runtime-rooms``):

- ``verify``: ``dhp verify``, a plan beside the unsplit transformers model;
- ``loop``: the training run (``train``, the supervisor, signals, run dirs, checkpoints,
  evaluation), the driver (``Trainer``) and the rank actor it drives (``ModuleWorker``);
- ``actors``: one module's ranks as Ray actors, their contracts, their failures;
- ``handoff`` and ``launch`` (independent): the rows between groups (graph, routing, transports,
  the bridge); the processes' start (preflight, Ray's start, the reaper, fork servers, devices).

Importing this package loads nothing: ``Trainer`` and ``StepResult`` (``dhp.runtime.loop.driver``,
``dhp.runtime.loop.driver_step``) are imported on first use. A Ray worker process imports only the
module its actor class lives in (a ``ModuleWorker`` never loads the driver, the data loader or the
planner's renderer).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"StepResult": "dhp.runtime.loop.driver_step", "Trainer": "dhp.runtime.loop.driver"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
