"""This machine's step-time profile: a sub-second probe at plan time, refined by every local run.

``dhp plan`` and ``dhp train`` call :func:`machine_profile` on the loaded config before planning:
for a local CPU cluster still on its built-in profile it returns the cluster numbers of this
machine (the cached fit of its earlier runs, else a fresh probe), which are written into the
config's ``cluster`` (``provenance`` says which). The planner itself stays pure: it only ever sees
a config. ``DHP_MACHINE_PROFILE=off`` turns this off (tests that need the built-in numbers).
"""

from dhp.machine.cache import machine_profile, record_run
from dhp.machine.probe import Probe, probe_machine

__all__ = ["Probe", "machine_profile", "probe_machine", "record_run"]
