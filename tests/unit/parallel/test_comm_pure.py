"""CommCounter's pure parts: the op table covers every collective kind, and metrics flattening."""

from __future__ import annotations

import pytest

from dhp.parallel.comm import _OPS, _RING, CommStats, comm_metrics

pytestmark = pytest.mark.unit


def test_every_counted_op_has_a_wire_model() -> None:
    assert {kind for kind, _ in _OPS.values()} <= set(_RING)
    # ring all-reduce moves 2(n-1)/n of the payload per rank; all-gather (n-1) shards
    assert _RING["all_reduce"](4) == pytest.approx(1.5)
    assert _RING["all_gather"](4) == 3.0


def test_metrics_are_flat_and_named_by_module_and_kind() -> None:
    stats = {"llm/all_reduce": CommStats(calls=3, payload_bytes=1024, wire_bytes=1024.0)}
    assert comm_metrics(stats) == {
        "comm/llm/all_reduce/calls": 3,
        "comm/llm/all_reduce/payload_bytes": 1024,
        "comm/llm/all_reduce/wire_bytes": 1024.0,
    }
