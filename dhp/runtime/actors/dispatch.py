"""Explicit dispatch and collect contracts for worker methods (verl-style single controller).

Every worker method the driver calls is declared with :func:`register`: how its arguments are
split over the group's ranks (``Dispatch``) and whose results count (``Collect``). The driver calls
it through the group with the method itself, ``group.call(ModuleWorker.finalize_grads)``; the
:class:`~dhp.runtime.actors.actor_group.ActorGroup` reads the contract from that function and never takes
a method name as a string; the driver never indexes ranks.

Rank layout inside a group is :class:`dhp.layout.ParallelLayout` (re-exported here): row-major over the
mesh axes ``dp, fsdp, sp, tp``, so ranks of one data replica (same batch, different SP/TP shards) are
contiguous.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from dhp.errors import RuntimeFailure
from dhp.layout import ParallelLayout

__all__ = [
    "CONTRACT_ATTR",
    "Collect",
    "Contract",
    "Dispatch",
    "ParallelLayout",
    "collect_results",
    "contract_of",
    "register",
    "split_args",
]

F = TypeVar("F", bound=Callable[..., Any])

CONTRACT_ATTR = "__dhp_contract__"


class Dispatch(enum.Enum):
    """How a call's positional arguments reach the ranks."""

    ONE_TO_ALL = "one_to_all"  # every rank gets the same arguments (one object-store put each)
    PER_RANK = "per_rank"  # each argument is a sequence of length world_size; rank r gets item r
    SHARD_BY_DP = "shard_by_dp"  # each argument has one item per data replica; its ranks share it


class Collect(enum.Enum):
    """Whose results the driver receives."""

    ALL = "all"  # list, one entry per rank
    RANK0 = "rank0"  # rank 0's result only (e.g. a loss that every TP rank holds identically)
    DP_LEADERS = "dp_leaders"  # the first rank of each data replica (e.g. TP rank 0 of each replica)
    NONE = "none"  # results are awaited (errors surface) and dropped


@dataclass(frozen=True)
class Contract:
    """The declared dispatch and collect modes of one worker method."""

    dispatch: Dispatch
    collect: Collect


def register(*, dispatch: Dispatch, collect: Collect) -> Callable[[F], F]:
    """Declare a worker method's contract; undecorated methods cannot be called through a group."""

    def wrap(fn: F) -> F:
        setattr(fn, CONTRACT_ATTR, Contract(dispatch=dispatch, collect=collect))
        return fn

    return wrap


def contract_of(worker_cls: type, method: Callable[..., Any]) -> Contract:
    """The contract of ``method``, a function of ``worker_cls`` such as ``ModuleWorker.build``.

    Calls name the worker's function object, not a string, so a reader (or a tool) goes from the call
    to the method and its :func:`register` line. A string, a function that ``worker_cls`` does not
    have, or a method without a contract is a programming error.
    """
    name = getattr(method, "__name__", None)
    if not callable(method) or name is None or getattr(worker_cls, name, None) is not method:
        raise RuntimeFailure(
            f"{method!r} is not a method of {worker_cls.__name__}; pass the worker's own function, "
            f"e.g. group.call({worker_cls.__name__}.<method>, ...)"
        )
    contract = getattr(method, CONTRACT_ATTR, None)
    if contract is None:
        raise RuntimeFailure(
            f"{worker_cls.__name__}.{name} has no dispatch/collect contract; "
            "decorate it with dhp.runtime.actors.dispatch.register(dispatch=..., collect=...)"
        )
    return contract


def split_args(
    contract: Contract, layout: ParallelLayout, method: str, args: Sequence[Any], kwargs: dict[str, Any]
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Per-rank ``(args, kwargs)`` for one call under ``contract``. Keyword args go to all ranks."""
    if contract.dispatch is Dispatch.ONE_TO_ALL:
        return [(tuple(args), kwargs)] * layout.world_size
    want = layout.world_size if contract.dispatch is Dispatch.PER_RANK else layout.num_replicas
    for i, arg in enumerate(args):
        if not isinstance(arg, Sequence) or len(arg) != want:
            got = len(arg) if isinstance(arg, Sequence) else type(arg).__name__
            raise RuntimeFailure(
                f"{method}: argument {i} must have {want} items ({contract.dispatch.value}), got {got}"
            )
    if contract.dispatch is Dispatch.PER_RANK:
        return [(tuple(a[r] for a in args), kwargs) for r in range(layout.world_size)]
    return [(tuple(a[layout.replica_of(r)] for a in args), kwargs) for r in range(layout.world_size)]


def collect_results(contract: Contract, layout: ParallelLayout, results: list[Any]) -> Any:
    """Select the results that count under ``contract`` from one result per rank."""
    if contract.collect is Collect.ALL:
        return results
    if contract.collect is Collect.RANK0:
        return results[0]
    if contract.collect is Collect.DP_LEADERS:
        return [results[r] for r in layout.leaders()]
    return None
