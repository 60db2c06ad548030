"""The step loader: per optimizer step, a list of micro-batches for every LLM data replica.

Runs on the driver. Each sample is loaded and processed exactly once and goes to exactly one data
replica (the runtime ships a replica's micro-batches to that replica's ranks), so DP shards are
disjoint and, over an epoch, complete. Order is a seeded permutation per epoch (``source.epoch_order``);
the stream runs on across epochs, so no sample is dropped at an epoch's end. The position in that
stream is the resumable state: resuming at step k yields the same batches as the unbroken run.

Balance: the ``global_batch_size`` samples of a step are dealt to the ``dp * micro_batches`` slots
greedily, largest vision patch count first, to the least-loaded slot, so micro-batch ``m`` carries
about the same vision tokens on every replica.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from dhp.config.constants import DATA_ENGINES
from dhp.config.schema import DataConfig, ModelConfig, RunConfig, TrainConfig
from dhp.config.validate_data_keys import data_engine_problems
from dhp.data import bad
from dhp.data.batch import Sample, VLBatch, collate
from dhp.data.holdout import split_source
from dhp.data.packing import pack, packed_max_tokens
from dhp.data.source import SampleSource, build_source, epoch_order
from dhp.errors import ConfigError, ConfigIssue, DataError
from dhp.layout import ParallelLayout
from dhp.models.graph import consumer_name, image_module, module_seq_lens, seq_limits

log = logging.getLogger("dhp.data")
WAIT_WARN_FRACTION = 0.10  # a step waiting longer than this share of its time on data is reported
ENGINES = DATA_ENGINES


@dataclass
class StepData:
    """One optimizer step's data: ``micro_batches[m][r]`` is micro-batch ``m`` of data replica ``r``.

    ``num_label_tokens`` is ``T``, the step's global label-token count after the shift (the loss
    normaliser, see docs/INTERFACES.md "Loss and gradient scaling"). ``bad_samples`` holds the
    cumulative skip counts by reason (empty under ``on_bad_sample=raise``). ``metrics``: the
    loader's figures for this step (wait, samples/s, workers; see :meth:`StepLoader.next_step`).
    ``skipped``: ``{location, reason, detail}`` of each sample skipped while building this step.
    """

    step: int
    micro_batches: list[list[VLBatch]]
    num_label_tokens: int
    bad_samples: dict[str, int]
    metrics: dict[str, float] = field(default_factory=dict)
    skipped: list[dict[str, str]] = field(default_factory=list)  # this step's skipped samples, named

    def replica(self, r: int) -> list[VLBatch]:
        """All micro-batches of data replica ``r``, in order."""
        return [mb[r] for mb in self.micro_batches]


@dataclass(frozen=True)
class LoaderSpec:
    """Shape of a step: replicas (llm ``dp*fsdp``), samples per step and per micro-batch, limits."""

    dp_size: int
    global_batch_size: int
    micro_batch_size: int
    patch_seq_len: int  # max patches per micro-batch of one replica (the image encoder's seq_len)
    pad_token_id: int
    on_bad_sample: str
    shuffle: bool
    seed: int
    num_workers: int = 0
    prefetch: bool = False
    max_tokens: int = 0  # > 0: pack each micro-batch into rows of <= max_tokens (dhp.data.packing)
    #: the config key of ``patch_seq_len``, for messages (``modules.<the image encoder>.seq_len``)
    patches_key: str = "modules.<image encoder>.seq_len"

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // (self.dp_size * self.micro_batch_size)

    def validate(self) -> None:
        """Raise ``ConfigError`` with every problem of the batch shape and policy."""
        issues = []
        per_step = self.dp_size * self.micro_batch_size
        if (
            min(self.dp_size, self.micro_batch_size, self.global_batch_size) <= 0
            or self.global_batch_size % per_step
        ):
            issues.append(
                ConfigIssue(
                    "train.global_batch_size",
                    self.global_batch_size,
                    f"must be a positive multiple of dp ({self.dp_size}) * micro_batch_size ({self.micro_batch_size})",
                    f"use {max(per_step, self.global_batch_size - self.global_batch_size % max(per_step, 1))}",
                )
            )
        if self.on_bad_sample not in bad.ON_BAD_SAMPLE:
            issues.append(
                ConfigIssue("data.on_bad_sample", self.on_bad_sample, "must be raise or skip", "pick one")
            )
        if self.num_workers < 0:
            issues.append(
                ConfigIssue("data.num_workers", self.num_workers, "must be >= 0", "use 0 (inline) or more")
            )
        if issues:
            raise ConfigError(issues)


class StepLoader:
    """Iterator of :class:`StepData`; ``state_dict``/``load_state_dict`` give an exact resume."""

    def __init__(
        self, *, source: SampleSource, sizes: list[int], weights: list[float], spec: LoaderSpec
    ) -> None:
        spec.validate()
        self.source = source
        self.sizes = sizes
        self.weights = weights
        self.spec = spec
        self.bad_log = bad.BadSampleLog()
        self.position = 0  # samples consumed from the epoch stream
        self.step = 0
        self._epoch = -1
        self._order: list[int] = []
        self.epoch_len = len(self._order_of(0))
        if self.epoch_len == 0:
            raise DataError("the configured datasets hold no samples. Fix: check data.datasets")
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="dhp-data") if spec.prefetch else None
        self._pending: Future | None = None
        self._served = self._snapshot()  # state after the last step handed out
        self._last_return: float | None = None  # when the previous step was handed out
        self._warned_wait = False
        self.skipped_records = bad.SkippedRecords(None)

    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._order = epoch_order(
                sizes=self.sizes,
                weights=self.weights,
                seed=self.spec.seed,
                epoch=epoch,
                shuffle=self.spec.shuffle,
            )
            self._epoch = epoch
        return self._order

    def _index_at(self, position: int) -> int:
        return self._order_of(position // self.epoch_len)[position % self.epoch_len]

    def _try_load(self, index: int) -> Sample | bad.BadSampleError:
        try:
            return self.source.load(index)
        except bad.BadSampleError as e:
            if self.spec.on_bad_sample == "raise":
                raise
            return e

    def _take(self, n: int) -> list[Sample]:
        """The next ``n`` good samples of the stream; bad ones raise or are counted (policy)."""
        good: list[Sample] = []
        bad_run = 0
        pool = ThreadPoolExecutor(self.spec.num_workers) if self.spec.num_workers else None
        try:
            while len(good) < n:
                want = n - len(good)
                start = self.position
                indices = [self._index_at(start + k) for k in range(want)]
                self.position += want
                results = list(pool.map(self._try_load, indices) if pool else map(self._try_load, indices))
                for k, res in enumerate(results):
                    bad_run = self._count_bad(start + k, res, bad_run)
                    if not isinstance(res, bad.BadSampleError):
                        good.append(res)
        finally:
            if pool:
                pool.shutdown()
        return good

    def _count_bad(self, position: int, res: object, bad_run: int) -> int:
        """The run of bad samples after the one at stream ``position``; raises ``DataError`` when it
        covers a whole epoch pass. The run restarts at each epoch's first position: bad records at the
        end of one epoch's order and the start of the next are not "every sample of an epoch"."""
        if position % self.epoch_len == 0:
            bad_run = 0
        if not isinstance(res, bad.BadSampleError):
            return 0
        self.bad_log.add(res)
        if bad_run + 1 >= self.epoch_len:
            raise DataError(f"every sample of an epoch was bad: {self.bad_log.summary()}")
        return bad_run + 1

    def record_skipped_to(self, path: Path | None) -> None:
        """Name every sample skipped from now on in ``path`` (a run dir's ``bad_samples.jsonl``, one JSON
        line each) and the first few on the console (:class:`~dhp.data.bad.SkippedRecords`)."""
        self.skipped_records = bad.SkippedRecords(path)

    def __iter__(self) -> StepLoader:
        return self

    def __next__(self) -> StepData:
        return self.next_step()

    @property
    def num_data_workers(self) -> int:
        """Processes or threads loading samples (``local``: threads, at least the caller's)."""
        return max(1, self.spec.num_workers)

    def next_step(self) -> StepData:
        """The next step's data. With ``prefetch`` it was built in the background during the previous
        step, and the step after it starts building now (errors surface when their step is asked for).

        ``data.metrics`` (metrics.jsonl's ``data``): ``wait_s`` (time this call blocked),
        ``samples_per_s`` (samples over the time the step took to build), ``workers``, ``epoch``
        (samples of the stream read through this step, bad ones included, over one epoch's). When the wait exceeds
        :data:`WAIT_WARN_FRACTION` of the time since the previous step was handed out (from the third
        step on), one warning names the fix.
        """
        t0 = time.perf_counter()
        if self._prefetcher is None:
            (data, build_s), self._served = self._produce()
        else:
            if self._pending is None:
                self._pending = self._prefetcher.submit(self._produce)
            try:
                (data, build_s), self._served = self._pending.result()
            finally:
                self._pending = None
            self._pending = self._prefetcher.submit(self._produce)
        now = time.perf_counter()
        wait = now - t0
        data.metrics = {
            "wait_s": wait,
            "samples_per_s": self.spec.global_batch_size / max(build_s, 1e-9),
            "workers": float(self.num_data_workers),
            "epoch": self._served["position"] / self.epoch_len,  # epochs of the stream read so far
        }
        if self._last_return is not None and data.step >= 2 and not self._warned_wait:
            period = now - self._last_return
            if wait > WAIT_WARN_FRACTION * period:
                self._warned_wait = True
                log.warning(
                    "data: step %d waited %.2f s of %.2f s (%.0f%%) for its samples. Fix: more CPU "
                    "workers (data.num_workers; data.engine=ray spreads them over the cluster), a "
                    "deeper data.prefetch_depth, or a smaller data.max_pixels",
                    data.step + 1,
                    wait,
                    period,
                    100 * wait / period,
                )
        self._last_return = now
        self.skipped_records.record(data.step + 1, data.skipped)  # 1-based, as metrics.jsonl's steps
        return data

    def _produce(self) -> tuple[tuple[StepData, float], dict]:
        t0 = time.perf_counter()
        data = self._build_step()
        return (data, time.perf_counter() - t0), self._snapshot()

    def _drain(self) -> None:
        """Wait for and drop a step being prefetched, and rewind the stream to the last step served,
        so the dropped step is built again when asked for (nothing is skipped)."""
        if self._pending is None:
            return
        self._pending.exception()  # waits; its error (if any) belongs to a step never asked for
        self._pending = None
        self.position = int(self._served["position"])
        self.step = int(self._served["step"])
        self.bad_log.load_state_dict(self._served["bad"])

    def close(self) -> None:
        """Stop prefetching (waits for a step in flight). The loader can still be used inline after."""
        self._drain()
        if self._prefetcher is not None:
            self._prefetcher.shutdown()
            self._prefetcher = None

    def _build_step(self) -> StepData:
        """Load, balance and collate the next step's samples (advances the stream)."""
        spec = self.spec
        samples = self._take(spec.global_batch_size)
        slots = balance(
            samples, num_slots=spec.num_micro_batches * spec.dp_size, slot_size=spec.micro_batch_size
        )
        micro: list[list[VLBatch]] = []
        for m in range(spec.num_micro_batches):
            row = []
            for r in range(spec.dp_size):
                members = [samples[i] for i in slots[m * spec.dp_size + r]]
                patches = sum(s.num_patches for s in members)
                if patches > spec.patch_seq_len:
                    raise DataError(
                        f"micro-batch {m} of replica {r} at step {self.step} holds {patches} patches > "
                        f"{spec.patches_key}={spec.patch_seq_len} ({[s.sample_id for s in members]}). "
                        f"Fix: lower train.micro_batch_size or data.max_pixels, or raise {spec.patches_key}"
                    )
                row.append(
                    pack(members, max_tokens=spec.max_tokens, pad_token_id=spec.pad_token_id)
                    if spec.max_tokens
                    else collate(members, pad_token_id=spec.pad_token_id)
                )
            micro.append(row)
        self.step += 1
        return StepData(
            step=self.step - 1,
            micro_batches=micro,
            num_label_tokens=sum(b.num_label_tokens for row in micro for b in row),
            bad_samples=dict(self.bad_log.counts),
            skipped=self.bad_log.take_recent(),
        )

    def fingerprint(self) -> dict:
        """What must match for a saved position to mean the same samples."""
        return {"num_samples": len(self.source), "epoch_len": self.epoch_len, "seed": self.spec.seed}

    def served_bad_log(self) -> bad.BadSampleLog:
        """Skipped samples up to the last step handed out (not counting a step being prefetched):
        ``.metrics()`` for metrics.jsonl, ``.summary()`` for the end-of-run summary."""
        log = bad.BadSampleLog()
        log.load_state_dict(self._served["bad"])
        return log

    def _snapshot(self) -> dict:
        return {
            "position": self.position,
            "step": self.step,
            "fingerprint": self.fingerprint(),
            "bad": self.bad_log.state_dict(),
        }

    def state_dict(self) -> dict:
        """JSON-able resume state after the last step handed out (a prefetched step is not counted):
        stream position, step, skip counts, and the data fingerprint."""
        return copy.deepcopy(self._served)

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position; raises ``DataError`` if the datasets or seed changed."""
        if state["fingerprint"] != self.fingerprint():
            raise DataError(
                f"cannot resume the data position: saved for {state['fingerprint']}, the configured data is "
                f"{self.fingerprint()}. Fix: resume with the same datasets, weights and train.seed"
            )
        self._drain()
        self.position = int(state["position"])
        self.step = int(state["step"])
        self.bad_log.load_state_dict(state["bad"])
        self._served = self._snapshot()


def balance(samples: list[Sample], *, num_slots: int, slot_size: int) -> list[list[int]]:
    """Deal sample indices to ``num_slots`` slots of exactly ``slot_size``: largest vision patch count
    (then token count) first, each to the least-loaded slot with room (ties: lowest slot). Pure;
    each slot lists its indices in stream order."""
    if len(samples) != num_slots * slot_size:
        raise ValueError(f"{len(samples)} samples for {num_slots} slots of {slot_size}")
    order = sorted(range(len(samples)), key=lambda i: (-samples[i].num_patches, -samples[i].num_tokens, i))
    slots: list[list[int]] = [[] for _ in range(num_slots)]
    load = [(0, 0)] * num_slots
    for i in order:
        open_slots = [s for s in range(num_slots) if len(slots[s]) < slot_size]
        s = min(open_slots, key=lambda k: (load[k], k))
        slots[s].append(i)
        load[s] = (load[s][0] + samples[i].num_patches, load[s][1] + samples[i].num_tokens)
    return [sorted(s) for s in slots]


def check_engine(data: DataConfig) -> None:
    """ConfigError for an unknown ``data.engine`` or a negative prefetch depth / CPU share (the
    config validation's rule, :func:`dhp.config.validate_data_keys.data_engine_problems`)."""
    issues = data_engine_problems(data)
    if issues:
        raise ConfigError(issues)


def build_loader(
    *,
    data: DataConfig,
    model: ModelConfig,
    train: TrainConfig,
    dp_size: int,
    patch_seq_len: int,
    token_seq_len: int,
    opened: tuple[SampleSource, list[int], list[float]] | None = None,
    seq_lens: Mapping[str, int] | None = None,
) -> StepLoader:
    """The step loader for ``data`` (DataConfig), ``model`` (ModelConfig) and ``train`` (TrainConfig).

    ``dp_size`` = the consumer's data replicas (its ``dp*fsdp``); ``patch_seq_len`` and
    ``token_seq_len`` = the image encoder's / the consumer's ``seq_len``. ``opened``: the source,
    sizes and weights when the caller opened them (:func:`open_training_data`); ``seq_lens``: every
    module's ``seq_len`` (:func:`dhp.models.graph.module_seq_lens`: the audio encoder's bounds one
    sample's mel frames).
    """
    check_engine(data)
    seq_key = f"modules.{consumer_name(model.family)}.seq_len"
    max_tokens = packed_max_tokens(data, token_seq_len=token_seq_len, seq_key=seq_key)
    if opened is None:
        opened, _ = open_training_data(
            data=data,
            model=model,
            train=train,
            patch_seq_len=patch_seq_len,
            token_seq_len=token_seq_len,
            seq_lens=seq_lens,
        )
    source, sizes, weights = opened
    spec = LoaderSpec(
        dp_size=dp_size,
        global_batch_size=train.global_batch_size,
        micro_batch_size=train.micro_batch_size,
        patch_seq_len=patch_seq_len,
        pad_token_id=model.tokens.pad_token_id,
        on_bad_sample=data.on_bad_sample,
        shuffle=data.shuffle,
        seed=train.seed,
        num_workers=data.num_workers,
        prefetch=data.prefetch,
        max_tokens=max_tokens,
        patches_key=f"modules.{image_module(model.family)}.seq_len",
    )
    if data.engine == "ray":
        from dhp.data.ray_engine import RayStepLoader

        return RayStepLoader(
            source=source,
            sizes=sizes,
            weights=weights,
            spec=spec,
            cpus_per_worker=data.cpus_per_worker,
            prefetch_depth=data.prefetch_depth,
        )
    return StepLoader(source=source, sizes=sizes, weights=weights, spec=spec)


def open_training_data(
    *,
    data: DataConfig,
    model: ModelConfig,
    train: TrainConfig,
    patch_seq_len: int,
    token_seq_len: int,
    seq_lens: Mapping[str, int] | None = None,
) -> tuple[tuple[SampleSource, list[int], list[float]], SampleSource | None]:
    """``((source, sizes, weights), held out)``: the training data, less the records
    ``data.eval.split`` holds out for evaluation (``dhp.data.holdout``; None without a split)."""
    source, sizes, weights = build_source(
        data=data,
        model=model,
        patch_seq_len=patch_seq_len,
        token_seq_len=token_seq_len,
        seed=train.seed,
        seq_lens=seq_lens,
    )
    if data.eval.split <= 0:
        return (source, sizes, weights), None
    kept, held = split_source(source, sizes, split=data.eval.split, seed=train.seed)
    return (kept, kept.sizes, weights), held


def build_run_loader(config: RunConfig, layouts: Mapping[str, ParallelLayout]) -> StepLoader:
    """:func:`build_loader` for a whole run: one batch per data replica of the LLM's layout (the
    plan's ``layouts``, ``dp*fsdp``), ``seq_len`` of each module (the image encoder's 0 when the run has
    none; :func:`dhp.models.graph.seq_limits`)."""
    patches, tokens = seq_limits(config.model.family, config.modules)
    return build_loader(
        data=config.data,
        model=config.model,
        train=config.train,
        dp_size=layouts[consumer_name(config.model.family)].num_replicas,
        patch_seq_len=patches,
        token_seq_len=tokens,
        seq_lens=module_seq_lens(config.modules),
    )
