"""``connect_ray`` refuses a dead address at once (Ray itself retries it for minutes)."""

from __future__ import annotations

import socket
import time

import pytest

from dhp.config.schema import ClusterConfig
from dhp.errors import PlanError
from dhp.runtime.loop.driver import connect_ray

pytestmark = pytest.mark.unit


def _closed_port() -> int:
    with socket.socket() as s:  # bound then released: nothing listens there afterwards
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_dead_address_is_a_plan_error_in_seconds(monkeypatch, scheme) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    address = f"{scheme}127.0.0.1:{_closed_port()}"
    t0 = time.monotonic()
    with pytest.raises(
        PlanError, match=r"no Ray cluster answers at .*cluster\.ray_address.*ray start --head"
    ):
        connect_ray(cluster=ClusterConfig(name="x", ray_address=address), plan=None)
    assert time.monotonic() - t0 < 10


def test_env_address_is_named_as_the_source(monkeypatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_closed_port()}")
    with pytest.raises(PlanError, match=r"from \$RAY_ADDRESS"):
        connect_ray(cluster=ClusterConfig(name="x"), plan=None)
