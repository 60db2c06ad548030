"""``data.engine=ray``: samples are read, decoded, processed and tokenized on Ray CPU actors.

Placement and bytes. ``data.num_workers`` data actors (``_DataWorker``, ``data.cpus_per_worker``
CPUs each, spread over the cluster's nodes) each hold one copy of the source (dataset indices,
tokenizer, image processor; shipped once through the object store). The driver keeps the seeded
per-epoch order and asks for stream positions ``position .. position + window`` (window =
``data.prefetch_depth`` steps of samples), in chunks of consecutive positions, round-robin over
the actors. Each call returns objects owned by the driver: the chunk's metadata (token ids,
labels, grids; a few KB a sample) and one object per sample with its pixel rows (stored on the
worker's node). The driver fetches only the metadata; the pixels travel
as :class:`~dhp.data.remote.RemoteRows` through routing to the vision ranks, which fetch them from
the object store. So balancing (largest patch count first) and the global token count are computed
exactly as with ``local``, from the same samples in the same order: the batches are identical.

Why actors fed with explicit positions rather than a Ray Data pipeline: (1) Ray Data hands its
output rows to the consuming process (the driver), so the pixels would pass through it; object refs
created inside its UDFs belong to its workers and die with them, while an actor call's returns
belong to the caller. (2) The step needs the whole global batch's metadata in one place to balance
it across replicas and micro-batches, and the exact next *good* sample at each stream position
(bad-sample policy, resumable position); a per-consumer ``streaming_split`` gives neither.
"""

from __future__ import annotations

import os
from typing import Any

from dhp.data import bad
from dhp.data.batch import Sample
from dhp.data.loader import StepLoader
from dhp.data.remote import RemoteRows
from dhp.errors import DataError

_POLL_S = 1.0  # ray.get poll period: notices a Ray shut down under a prefetching thread


class _DataWorker:
    """One Ray data actor: loads samples of the shared source by global index."""

    def __init__(self, holder: list[Any]) -> None:
        import ray

        self.source = ray.get(holder[0])

    def ready(self) -> bool:
        return True

    def load(self, indices: list[int]) -> tuple[Any, ...]:
        """``(metas, pixels_0, ..., pixels_{k-1})`` for ``indices``: a meta is the Sample without
        pixels plus ``(rows, width)``, or the bad sample's fields; pixels a float32 ``(rows, width)``
        numpy array or None. Each pixel array is its own object (read by one vision rank)."""
        metas, pixels = [], []
        for index in indices:
            try:
                s = self.source.load(index)
            except bad.BadSampleError as e:
                metas.append(("bad", e.location, e.reason, e.detail, e.fix))
                pixels.append(None)
                continue
            px, s.pixel_values = s.pixel_values, None
            if px is None:
                metas.append(("ok", s, 0, 0))
                pixels.append(None)
            else:
                metas.append(("ok", s, int(px.shape[0]), int(px.shape[1])))
                pixels.append(px.contiguous().numpy())
        return (metas, *pixels)


class RayStepLoader(StepLoader):
    """:class:`StepLoader` whose samples come from Ray data actors; pixels never reach the driver."""

    def __init__(self, *, cpus_per_worker: float, prefetch_depth: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cpus_per_worker = cpus_per_worker
        self.prefetch_depth = max(1, prefetch_depth)
        self._actors: list[Any] = []
        self._inflight: dict[int, tuple[Any, int, Any]] = {}  # position -> (metas, j, pixels)
        self._metas: tuple[Any, list] | None = None  # the last fetched call's metas
        self._calls = 0
        self._next_submit = 0
        self._owns_ray = False

    @property
    def num_data_workers(self) -> int:
        return len(self._actors) or self._want_workers()

    def _want_workers(self) -> int:
        if self.spec.num_workers:
            return self.spec.num_workers
        try:
            import ray

            return max(1, int(ray.cluster_resources().get("CPU", 1))) if ray.is_initialized() else 1
        except Exception:
            return 1

    def _start(self) -> None:
        """Start the data actors (Ray must be up: the trainer connects it; else a local one)."""
        import ray

        if not ray.is_initialized():  # $RAY_ADDRESS if set, else a fresh local instance (never a stray head)
            address = None if os.environ.get("RAY_ADDRESS") else "local"
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
            self._owns_ray = True
        n = self._want_workers()
        total = ray.cluster_resources().get("CPU", 0.0)
        if self.cpus_per_worker * n > total:
            raise DataError(
                f"data.engine=ray: {n} data workers x data.cpus_per_worker={self.cpus_per_worker} CPUs "
                f"> the cluster's {total:g} CPUs. Fix: lower data.num_workers or data.cpus_per_worker "
                "(0 runs them unreserved), or add CPU nodes"
            )
        holder = [ray.put(self.source)]
        nodes = [nd for nd in ray.nodes() if nd["Alive"]]
        actor = ray.remote(_DataWorker).options(
            num_cpus=self.cpus_per_worker, scheduling_strategy="SPREAD" if len(nodes) > 1 else "DEFAULT"
        )
        self._actors = [actor.remote(holder) for _ in range(n)]
        ray.get([a.ready.remote() for a in self._actors])
        self._next_submit = self.position

    def _reset_inflight(self) -> None:
        """Drop everything in flight (the position was moved): refs go, objects are freed."""
        self._inflight.clear()
        self._metas = None
        self._next_submit = self.position

    def _fill(self, upto: int) -> None:
        """Ask for positions ``_next_submit .. upto`` in chunks of :attr:`chunk`, round-robin."""
        p = max(self._next_submit, self.position)
        while p < upto:
            idx = [self._index_at(q) for q in range(p, p + self.chunk)]
            actor = self._actors[self._calls % len(self._actors)]
            self._calls += 1
            refs = actor.load.options(num_returns=1 + len(idx)).remote(idx)
            for j in range(len(idx)):
                self._inflight[p + j] = (refs[0], j, refs[1 + j])
            p += len(idx)
        self._next_submit = max(self._next_submit, p)

    @property
    def chunk(self) -> int:
        """Samples per actor call: a step's share per worker (fewer calls, less driver CPU), <= 8."""
        return max(1, min(8, self.spec.global_batch_size // max(1, len(self._actors))))

    def _meta(self, ref: Any, j: int) -> Any:
        if self._metas is None or self._metas[0] is not ref:
            self._metas = (ref, self._get(ref))
        return self._metas[1][j]

    def _get(self, ref: Any) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError

        while True:
            try:
                return ray.get(ref, timeout=_POLL_S)
            except GetTimeoutError:
                if not ray.is_initialized():
                    raise DataError("Ray was shut down while a data step was being built") from None

    def _take(self, n: int) -> list[Sample]:
        """The next ``n`` good samples, in stream order; bad ones raise or are counted (policy)."""
        if not self._actors:
            self._start()
        if self._next_submit != self.position and self.position not in self._inflight:
            self._reset_inflight()
        window = self.prefetch_depth * self.spec.global_batch_size
        good: list[Sample] = []
        bad_run = 0
        while len(good) < n:
            self._fill(self.position + max(window, n - len(good)))
            meta_ref, j, px_ref = self._inflight.pop(self.position)
            self.position += 1
            meta = self._meta(meta_ref, j)
            if meta[0] == "bad":
                err = bad.BadSampleError(location=meta[1], reason=meta[2], detail=meta[3], fix=meta[4])
                if self.spec.on_bad_sample == "raise":
                    self._reset_inflight()
                    raise err
                bad_run = self._count_bad(self.position - 1, err, bad_run)
                continue
            bad_run = self._count_bad(self.position - 1, None, bad_run)
            _, sample, rows, width = meta
            if rows:
                sample.pixel_values = RemoteRows(((px_ref, 0, rows),), width)
            good.append(sample)
        return good

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._reset_inflight()

    def _drain(self) -> None:
        had = self._pending is not None
        super()._drain()
        if had:
            self._reset_inflight()

    def close(self) -> None:
        """Stop prefetching and the data actors (and a Ray this loader started)."""
        super().close()
        import ray

        if ray.is_initialized():
            for a in self._actors:
                ray.kill(a)
            if self._owns_ray:
                ray.shutdown()
        self._actors, self._inflight, self._owns_ray = [], {}, False
