"""Failure messages carry no terminal colour codes (Ray colours its errors; dhp's console adds
colour only on a TTY)."""

from __future__ import annotations

import pytest

from dhp.runtime.actors.actor_group import _first_line

pytestmark = pytest.mark.unit


def test_first_line_strips_ansi_codes() -> None:
    err = RuntimeError("\x1b[36mray::ModuleWorker.step()\x1b[39m (pid=1, ip=10.0.0.1)\nmore")
    assert _first_line(err) == "ray::ModuleWorker.step() (pid=1, ip=10.0.0.1)"
    assert _first_line(RuntimeError("")) == "RuntimeError"
