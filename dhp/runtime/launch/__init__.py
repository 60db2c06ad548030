"""Launch: how a run's processes start and end, before any model code runs.

Owns the checks a run passes before any process starts (``preflight``), Ray's start beside the
driver's imports and the start-up's phase table (``startup``), the reaper that stops a local Ray
when its driver dies (``reaper``), the pre-imported fork server each node's rank processes are
forked from (``forkserver``; ``forklaunch`` is the command Ray runs in a rank's place, by file path;
``forknodes``: one server per node of a joined cluster) and the GPU a rank is given (``devices``).

The bottom room of ``dhp.runtime``: it imports no other room (``lint-imports``, contract
``runtime-rooms``). Nothing here touches placements or memory of a model.
"""
