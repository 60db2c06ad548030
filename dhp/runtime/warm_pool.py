"""Warm rank actors: keep a finished run's actor processes and placement groups for the next run.

A rank actor's process spends most of its start importing torch, transformers and the model code
(~9 s of CPU on a small machine, per process). A driver that runs several short runs one after the
other on one Ray instance (a test session, a sweep) can keep them instead of killing them:

- ``Trainer.close(graceful=True)`` calls ``reset`` on every rank (the rank leaves its worlds and
  drops its module, optimizer, channel and caches; only the imported code stays), then parks the
  actors here with their placement groups, still reserved.
- The next ``reserve`` takes a parked placement group whose bundles and strategy equal a requested
  one (the most recently parked first), and ``ActorGroup`` re-initialises a parked actor that sits
  in the same bundle with the same resources and class (``reinit``) instead of starting a process.
  Parked actors of a taken group that no rank claims are killed before any rank is awaited.
- Parked groups that a run does not take stay parked for a later run (runs of several shapes
  alternate in a test session) while the cluster has room: before new groups are reserved, the
  oldest parked groups are removed until the cluster's free resources cover them, and if Ray still
  cannot place them, every parked group is removed and the reservation waits again. At most
  :data:`MAX_PARKED_ACTORS` processes stay parked (oldest removed first).

Placement is unchanged: a reused rank sits in the bundle the plan gives it. Memory: between runs a
parked process holds only its interpreter and imported modules (no tensors). A failed or
non-graceful close never parks anything. Disabled unless :func:`enable` was called; entries from
another Ray instance (after ``ray.shutdown``) are forgotten, never reused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

SlotKey = tuple[int, float, float, str]  # bundle index, num_cpus, num_gpus, worker class

# Parked processes kept at most: each holds its interpreter with torch and transformers imported
# (a few hundred MB of host memory, no tensors).
MAX_PARKED_ACTORS = 12


@dataclass
class _Parked:
    pg: Any
    key: tuple[Any, ...]  # (bundles, strategy) as hashable tuples
    actors: list[tuple[SlotKey, Any]] = field(default_factory=list)


def pg_key(bundles: Sequence[dict[str, float]], strategy: str) -> tuple[Any, ...]:
    """A placement group's identity for reuse: its bundles (in order) and strategy."""
    return (tuple(tuple(sorted(b.items())) for b in bundles), strategy)


def slot_key(bundle_index: int, num_cpus: float, num_gpus: float, worker_cls: type) -> SlotKey:
    return (
        bundle_index,
        float(num_cpus),
        float(num_gpus),
        f"{worker_cls.__module__}.{worker_cls.__qualname__}",
    )


class WarmPool:
    """Parked placement groups with their reset actors (see the module docstring)."""

    def __init__(self) -> None:
        self._parked: list[_Parked] = []
        self._leased: dict[Any, _Parked] = {}  # pg id -> entry whose actors the new run may claim
        self._session: str | None = None
        self.reused = 0  # actors re-initialised instead of started (for tests and logs)

    def parked_groups(self) -> int:
        """How many placement groups are parked now."""
        return len(self._parked)

    def parked_actors(self) -> int:
        """How many reset actors wait in parked placement groups now."""
        return sum(len(p.actors) for p in self._parked)

    # ---- the Ray instance -------------------------------------------------------------------
    def _check_session(self) -> bool:
        """Whether Ray is up; forget everything parked under another instance."""
        import ray

        if not ray.is_initialized():
            self._forget()
            return False
        session = ray.get_runtime_context().get_node_id()
        if session != self._session:
            self._forget()
            self._session = session
        return True

    def _forget(self) -> None:
        self._parked, self._leased = [], {}

    # ---- taking -------------------------------------------------------------------------------
    def take(self, requests: Sequence[tuple[list[dict[str, float]], str]]) -> list[Any]:
        """Per requested ``(bundles, strategy)``, a parked placement group equal to it, or None.
        Then the oldest parked groups are removed until the cluster's free resources cover the
        requests left without one (:meth:`make_room`)."""
        if not self._check_session():
            return [None] * len(requests)
        out: list[Any] = []
        for bundles, strategy in requests:
            key = pg_key(bundles, strategy)
            hit = next((p for p in reversed(self._parked) if p.key == key), None)
            if hit is None:
                out.append(None)
                continue
            self._parked.remove(hit)
            self._leased[hit.pg.id] = hit
            out.append(hit.pg)
        self.make_room([r for r, pg in zip(requests, out, strict=True) if pg is None])
        return out

    def make_room(self, requests: Sequence[tuple[list[dict[str, float]], str]]) -> None:
        """Remove parked groups, oldest first, until Ray's free resources (plus what is removed)
        cover the bundles of ``requests``. A cluster-wide sum: ``reserve`` drains the rest if the
        groups still cannot be placed on a node."""
        import ray

        need: dict[str, float] = {}
        for bundles, _ in requests:
            for b in bundles:
                for k, v in b.items():
                    need[k] = need.get(k, 0.0) + float(v)
        if not need or not self._parked:
            return
        free = {k: float(v) for k, v in ray.available_resources().items()}
        while self._parked and any(free.get(k, 0.0) + 1e-9 < v for k, v in need.items()):
            oldest = self._parked.pop(0)
            _remove([oldest])
            for bundle in oldest.key[0]:
                for k, v in bundle:
                    free[k] = free.get(k, 0.0) + float(v)

    def claim(self, pg: Any, key: SlotKey) -> Any:
        """A parked actor of ``pg`` with slot ``key`` (it must be ``reinit``-ed), or None."""
        entry = self._leased.get(pg.id)
        if entry is None:
            return None
        for i, (k, handle) in enumerate(entry.actors):
            if k == key:
                del entry.actors[i]
                self.reused += 1
                return handle
        return None

    def evict_unclaimed(self, pgs: Sequence[Any]) -> None:
        """Kill the parked actors of ``pgs`` that no rank claimed (they hold bundle resources)."""
        for pg in pgs:
            entry = self._leased.pop(getattr(pg, "id", None), None)
            if entry is not None:
                _kill([h for _, h in entry.actors])

    # ---- parking ------------------------------------------------------------------------------
    def park(self, pgs: Sequence[Any], keys: Sequence[tuple[list[dict[str, float]], str]], actors) -> None:
        """Keep reset ``actors`` (``(pg index, slot key, handle)``) and the placement groups ``pgs``
        (reserved as ``keys``)."""
        if not self._check_session():
            return
        entries = [_Parked(pg=pg, key=pg_key(*k)) for pg, k in zip(pgs, keys, strict=True)]
        for pg_index, key, handle in actors:
            entries[pg_index].actors.append((key, handle))
        self._parked.extend(entries)
        while self.parked_actors() > MAX_PARKED_ACTORS:
            _remove([self._parked.pop(0)])

    def drain(self) -> None:
        """Kill every parked actor and remove every parked placement group."""
        parked, self._parked = self._parked, []
        _remove(parked)


def _remove(entries: Sequence[_Parked]) -> None:
    """Kill the actors of parked ``entries`` and remove their placement groups (if Ray is up)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    if not ray.is_initialized():
        return
    for p in entries:
        _kill([h for _, h in p.actors])
        with contextlib.suppress(Exception):
            remove_placement_group(p.pg)


def _kill(handles: Sequence[Any]) -> None:
    import ray

    for h in handles:
        with contextlib.suppress(Exception):
            ray.kill(h, no_restart=True)


_POOL: WarmPool | None = None


def pool() -> WarmPool | None:
    """The active pool, or None (the default: every run starts and kills its own processes)."""
    return _POOL


def enable() -> WarmPool:
    """Park finished runs' actors from now on (idempotent); returns the pool."""
    global _POOL
    if _POOL is None:
        _POOL = WarmPool()
    return _POOL


def disable() -> None:
    """Kill everything parked and stop parking."""
    global _POOL
    if _POOL is not None:
        _POOL.drain()
    _POOL = None


def drain() -> None:
    """Kill everything parked (the pool stays enabled): frees the resources parked groups hold."""
    if _POOL is not None:
        _POOL.drain()


@contextlib.contextmanager
def warm_workers() -> Iterator[WarmPool]:
    """``with warm_workers():`` runs inside reuse each other's rank processes; all killed at exit."""
    was = _POOL
    p = enable()
    try:
        yield p
    finally:
        if was is None:
            disable()
