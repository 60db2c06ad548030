"""The evaluation data: every eval sample once per pass, in order, as batches shaped like a step.

``data.eval.path`` (a file of its own, any format ``data.path`` takes) or ``data.eval.split`` (the
records :mod:`dhp.data.holdout` keeps out of training) gives the eval samples, processed exactly as
training samples (chat template, ``data.train_on``, limits). A pass cuts them, in index order, into
batches of ``data.eval.batch_size`` samples (0: ``train.global_batch_size``) dealt to the LLM's data
replicas and micro-batches as a training step's (:func:`dhp.data.loader.balance`), so each batch
runs on every rank of every group. The last batch is topped up with copies of its own samples
whose labels are all ignored (``#fill``): they keep every replica's collectives in step and add
no label token, so the eval loss is over each eval sample exactly once. Bad samples follow
``data.on_bad_sample`` (skipped ones are counted in the pass's ``bad_samples``).

Placement and memory: runs on the driver (local threads, whatever ``data.engine``), one batch in
memory at a time; each pass decodes its images again (nothing is cached).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
from omegaconf import OmegaConf

from dhp.config.schema import DataConfig, DatasetEntry, RunConfig
from dhp.data import bad
from dhp.data.batch import IGNORE_INDEX, Sample
from dhp.data.loader import LoaderSpec, StepData, StepLoader, build_loader, open_training_data
from dhp.data.packing import packed_max_tokens
from dhp.data.source import SampleSource, build_source
from dhp.layout import ParallelLayout
from dhp.models.graph import consumer_name, module_seq_lens, seq_limits

FILL = "#fill"  # suffix of the sample id of a top-up copy (no label token)
EVAL_SAMPLES = "eval_samples"  # StepData.metrics of an eval batch: its samples, top-up copies not counted


class _Exhausted(Exception):
    """Internal: no eval sample left for another batch."""


class _EvalLoader(StepLoader):
    """The step loader's batching over the eval samples: positions ``0..limit-1`` once, in order,
    the last batch topped up (see the module docstring)."""

    def __init__(self, *, limit: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.limit = min(limit, len(self.source)) if limit > 0 else len(self.source)
        self.real = 0  # eval samples in the batch built last (the rest are top-up copies)

    def _take(self, n: int) -> list[Sample]:
        good: list[Sample] = []
        pool = ThreadPoolExecutor(self.spec.num_workers) if self.spec.num_workers else None
        try:
            while len(good) < n and self.position < self.limit:
                indices = range(self.position, min(self.limit, self.position + n - len(good)))
                self.position = indices.stop
                loads = pool.map(self._try_load, indices) if pool else map(self._try_load, indices)
                for res in loads:
                    if isinstance(res, bad.BadSampleError):
                        self.bad_log.add(res)
                    else:
                        good.append(res)
        finally:
            if pool:
                pool.shutdown()
        if not good:
            raise _Exhausted
        self.real = real = len(good)
        good += [_fill(good[k % real]) for k in range(n - real)]
        return good


def _fill(sample: Sample) -> Sample:
    """A copy of ``sample`` that carries no loss (a top-up of the last eval batch)."""
    return dataclasses.replace(
        sample, sample_id=sample.sample_id + FILL, labels=torch.full_like(sample.labels, IGNORE_INDEX)
    )


class EvalBatches:
    """Iterate once per eval pass: each ``StepData`` is one eval batch (``step`` counts batches)."""

    def __init__(self, *, source: SampleSource, spec: LoaderSpec, max_samples: int = 0) -> None:
        self.loader = _EvalLoader(
            source=source, sizes=[len(source)], weights=[1.0], spec=spec, limit=max_samples
        )

    @property
    def num_samples(self) -> int:
        """Eval samples a pass reads (before any bad one is skipped)."""
        return self.loader.limit

    @property
    def batch_size(self) -> int:
        return self.loader.spec.global_batch_size

    def __iter__(self) -> Iterator[StepData]:
        loader = self.loader
        loader.position, loader.step = 0, 0
        loader.bad_log = bad.BadSampleLog()
        while loader.position < loader.limit:
            try:
                data = loader._build_step()
            except _Exhausted:
                return
            data.metrics = {EVAL_SAMPLES: float(loader.real)}
            yield data

    def skipped(self) -> dict[str, int]:
        """Bad eval samples skipped in the last pass, by reason."""
        return dict(self.loader.bad_log.counts)


def eval_source(config: RunConfig, *, held: SampleSource | None, patch_seq_len: int, token_seq_len: int):
    """The eval samples: ``held`` (the split's records) or ``data.eval.path``'s; None without eval."""
    ev = config.data.eval
    if ev.split > 0:
        return held
    if not ev.path:
        return None
    source, _, _ = build_source(
        data=_eval_data(config.data),
        model=config.model,
        patch_seq_len=patch_seq_len,
        token_seq_len=token_seq_len,
        seed=config.train.seed,
        seq_lens=module_seq_lens(config.modules),
    )
    return source


def _eval_data(data: DataConfig) -> DataConfig:
    """``data`` with ``data.eval.path`` as its one dataset (the same processing settings)."""
    out = copy.deepcopy(data)
    OmegaConf.set_readonly(out, False)
    ev = data.eval
    entry = DatasetEntry(name="eval", path=str(ev.path), format=str(ev.format), image_root=str(ev.image_root))
    out.datasets = [OmegaConf.structured(entry)]
    out.kind = "llava"
    return out


def build_run_data(
    config: RunConfig, layouts: Mapping[str, ParallelLayout]
) -> tuple[StepLoader, EvalBatches | None]:
    """The run's step loader and its eval batches (None without ``data.eval``), both opened here:
    a missing file, an unknown format or a tokenizer that disagrees fails before the run starts."""
    patches, tokens = seq_limits(config.model.family, config.modules)
    dp = layouts[consumer_name(config.model.family)].num_replicas
    seq_lens = module_seq_lens(config.modules)
    opened, held = open_training_data(
        data=config.data,
        model=config.model,
        train=config.train,
        patch_seq_len=patches,
        token_seq_len=tokens,
        seq_lens=seq_lens,
    )
    loader = build_loader(
        data=config.data,
        model=config.model,
        train=config.train,
        dp_size=dp,
        patch_seq_len=patches,
        token_seq_len=tokens,
        opened=opened,
        seq_lens=seq_lens,
    )
    source = eval_source(config, held=held, patch_seq_len=patches, token_seq_len=tokens)
    if source is None:
        return loader, None
    ev, train = config.data.eval, config.train
    spec = dataclasses.replace(
        loader.spec,
        global_batch_size=ev.batch_size or train.global_batch_size,
        shuffle=False,
        prefetch=False,
        max_tokens=packed_max_tokens(
            config.data, token_seq_len=tokens, seq_key=f"modules.{consumer_name(config.model.family)}.seq_len"
        ),
    )
    return loader, EvalBatches(source=source, spec=spec, max_samples=ev.max_samples)
