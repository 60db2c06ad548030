"""Dispatch/collect contracts: pure, no processes."""

import re
from pathlib import Path

import pytest

from dhp.errors import RuntimeFailure
from dhp.runtime.actors.dispatch import (
    Collect,
    Contract,
    Dispatch,
    ParallelLayout,
    collect_results,
    contract_of,
    register,
    split_args,
)

pytestmark = pytest.mark.unit


class _W:
    @register(dispatch=Dispatch.SHARD_BY_DP, collect=Collect.DP_LEADERS)
    def fwd(self, batch):
        return batch

    def undeclared(self):
        return None


class _Other:
    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def fwd(self, batch):
        return batch


class _Sub(_W):
    pass


def test_layout_from_mesh_groups_sp_and_tp_ranks_into_replicas():
    layout = ParallelLayout.from_config({"dp": 2, "tp": 2})
    assert layout.world_size == 4 and layout.num_replicas == 2
    assert [layout.replica_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert layout.leaders() == [0, 2]
    assert ParallelLayout.from_config({"fsdp": 3}).num_replicas == 3  # fsdp ranks see different data


def test_units_are_tp_groups_and_their_leader_is_tp_rank_0():
    layout = ParallelLayout.from_config({"dp": 2, "sp": 2, "tp": 2})  # 8 ranks, 4 units (dp x sp)
    assert layout.num_units == 4 and layout.num_replicas == 2
    assert [layout.unit_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [layout.unit_leader(u) for u in range(4)] == [0, 2, 4, 6]
    assert ParallelLayout.from_config({"dp": 2, "sp": 2}).num_units == 4  # tp 1: a unit is a rank


def test_split_and_collect_follow_the_contract():
    layout = ParallelLayout.from_config({"dp": 2, "sp": 2})
    c = contract_of(_W, _W.fwd)
    per_rank = split_args(c, layout, "fwd", (["a", "b"],), {"k": 1})
    assert [a for a, _ in per_rank] == [("a",), ("a",), ("b",), ("b",)]
    assert all(kw == {"k": 1} for _, kw in per_rank)
    assert collect_results(c, layout, [10, 11, 12, 13]) == [10, 12]
    one = Contract(Dispatch.ONE_TO_ALL, Collect.RANK0)
    assert split_args(one, layout, "m", ("x",), {})[3] == (("x",), {})
    assert collect_results(one, layout, [7, 8, 9, 10]) == 7
    per = Contract(Dispatch.PER_RANK, Collect.NONE)
    assert [a for a, _ in split_args(per, layout, "m", ([0, 1, 2, 3],), {})] == [(0,), (1,), (2,), (3,)]
    assert collect_results(per, layout, [1, 2, 3, 4]) is None


def test_wrong_arity_and_missing_contract_are_errors():
    layout = ParallelLayout.from_config({"dp": 2})
    with pytest.raises(RuntimeFailure, match=r"fwd: argument 0 must have 2 items \(shard_by_dp\), got 3"):
        split_args(contract_of(_W, _W.fwd), layout, "fwd", ([1, 2, 3],), {})
    with pytest.raises(RuntimeFailure, match=r"_W\.undeclared has no dispatch/collect contract"):
        contract_of(_W, _W.undeclared)


def test_a_call_names_the_worker_function_not_a_string():
    # the contract is read from the function itself; an inherited method is the worker's own
    assert contract_of(_Sub, _W.fwd) == Contract(Dispatch.SHARD_BY_DP, Collect.DP_LEADERS)
    with pytest.raises(RuntimeFailure, match=r"'fwd' is not a method of _W; pass the worker's own function"):
        contract_of(_W, "fwd")
    # a same-named method of another worker class has its own contract: refused, not looked up by name
    with pytest.raises(RuntimeFailure, match=r"is not a method of _W"):
        contract_of(_W, _Other.fwd)


def test_no_call_site_names_a_worker_method_by_string():
    # group.submit/call("name") would fail only when the run reaches it (e.g. an async checkpoint)
    root = Path(__file__).resolve().parents[3]
    pattern = re.compile(r"\.(submit|call)\(\s*[\"']")
    hits = [
        f"{p.relative_to(root)}:{n}: {line.strip()}"
        for folder in ("dhp", "scripts", "tests/integration")
        for p in sorted((root / folder).rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == [], "\n".join(hits)
