"""One local Ray for the integration tests that drive the runtime in this process.

``ray_local`` starts it on first use (4 logical CPUs, dhp's own local settings) and leaves it up
for the next module: starting and stopping Ray costs ~8 s of CPU each time. It stops after the
last integration test (the next tests, e.g. unit tests of Ray connection, expect no Ray in this
process), and at the end of the session. A module that needs a cluster of its own (several nodes, an external head) calls
``ray.shutdown()`` first; the next ``ray_local`` starts a fresh instance. Tests that run the CLI
in a subprocess are unaffected: ``dhp`` there starts its own instance with ``address="local"``.

The workers of that instance can import the helpers beside the tests (``PYTHONPATH``), as the
actor-group test's echo worker needs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray

from dhp.ray_connect import LOCAL_RAY
from dhp.runtime.launch import forkserver

RAY_CPUS = 4


@pytest.fixture(scope="module")
def ray_local():
    """The shared local Ray instance (started here if this process has none), its rank processes
    forked from a fork server as ``dhp train`` does (dhp.runtime.launch.forkserver)."""
    if not ray.is_initialized():
        here = str(Path(__file__).resolve().parent)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        ray.init(address="local", num_cpus=RAY_CPUS, **LOCAL_RAY)
    # whoever started this process's Ray (this fixture, or an in-process command of an earlier
    # module), it runs on this machine: its ranks fork from one server, started once per session
    if forkserver.current() is None and forkserver.enabled():
        forkserver.ForkServer.start(
            preload=(*forkserver.BASE_PRELOAD, *forkserver.family_modules("qwen2_5_vl"))
        )
    forkserver.use_for_local_ray()
    yield


def _down() -> None:
    ray.shutdown()
    forkserver.close_current()  # the unit tests after these expect no server in this process


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the shared Ray when the next test is not an integration test (or there is none), after
    the fixtures torn down here (a module's Trainer closes its actors on a live Ray first)."""
    result = yield
    here = Path(__file__).resolve().parent
    if nextitem is None or here not in Path(nextitem.path).resolve().parents:
        _down()
    return result


@pytest.fixture(scope="session", autouse=True)
def _ray_down_at_the_end():
    yield
    _down()
