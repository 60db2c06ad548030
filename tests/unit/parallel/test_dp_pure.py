"""Pure pieces of DP/ZeRO-1 and the grad-norm accounting: no processes."""

from __future__ import annotations

import pytest

from dhp.parallel.dp import partition_params

pytestmark = pytest.mark.unit


def test_partition_is_balanced_and_deterministic() -> None:
    sizes = [1000, 10, 500, 500, 10, 990, 5]
    owners = partition_params(sizes, 2)
    assert owners == partition_params(sizes, 2)
    load = [sum(s for s, o in zip(sizes, owners, strict=True) if o == r) for r in range(2)]
    assert sorted(load) == [1505, 1510]  # greedy largest-first: 1000+500+5 | 990+500+10+10


def test_every_param_has_one_owner_even_with_more_ranks_than_params() -> None:
    owners = partition_params([3, 2], 4)
    assert owners == [0, 1]  # ranks 2 and 3 own nothing (their ZeRO-1 AdamW has an empty group)
    assert partition_params([], 3) == []
