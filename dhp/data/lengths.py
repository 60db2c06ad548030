"""The data's own lengths for the step-time estimate of a real-data run, measured at plan time.

A real-data micro-batch is as long as its samples: the loader right-pads the LLM rows to the longest
sample of the micro-batch and concatenates the samples' patches (``dhp.data.batch.collate``), so a
plan that times micro-batches filled to ``modules.<m>.seq_len`` can be several times slow on data
much shorter than its bound. :func:`with_data_lengths` measures a bounded, deterministic sample of
the configured datasets with the same source and processing as ``dhp data check``
(``build_source``: records read, images decoded and processed, conversations tokenized) and writes
the per-row counts into ``data.lengths`` of the config, which the planner reads
(``dhp.plan.estimate.timing_shapes``). Nothing here starts Ray.

Sample: at most :data:`SAMPLE_ROWS` rows spread evenly over one unshuffled epoch (each dataset
repeated by its weight, ``epoch_order``), the same rows on every call. Results are cached under
``$DHP_CACHE_DIR/data_lengths/`` by the datasets' files (paths, sizes, modification times; a
folder's own, which a file added or removed changes) and every setting the counts depend on; a
changed file or setting measures again. Data that cannot be read
leaves ``data.lengths`` unmeasured with the reason in ``note``: the estimate then fills every
micro-batch to ``seq_len`` and says why.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dhp.config.schema import DataConfig, DataLengths, ModelConfig
from dhp.data.bad import BadSampleError
from dhp.data.check import load_or_bad
from dhp.data.dataset_info import resolve_info
from dhp.data.llava import resolve_path
from dhp.data.source import build_source, epoch_order
from dhp.data.wds import expand_shards
from dhp.errors import DataError, DhpError

#: rows measured at most (the demo set's 25 all fit; a large set costs ~SAMPLE_ROWS samples' processing)
SAMPLE_ROWS = 64
CACHE_ENV = "DHP_CACHE_DIR"  # the cache root, as dhp.machine.cache reads it (default ~/.cache/dhp)
CACHE_VERSION = 1  # bump when what is measured changes


def sample_indices(sizes: list[int], weights: list[float], *, seed: int, rows: int) -> tuple[list[int], int]:
    """(global indices of at most ``rows`` rows spread evenly over one unshuffled epoch, the epoch's
    length). Deterministic: the same datasets, weights and seed give the same rows."""
    order = epoch_order(sizes=sizes, weights=weights, seed=seed, epoch=0, shuffle=False)
    n = len(order)
    if n <= rows:
        return order, n
    return [order[i * n // rows] for i in range(rows)], n


def measure_lengths(
    *,
    data: DataConfig,
    model: ModelConfig,
    vision_seq_len: int,
    llm_seq_len: int,
    seed: int = 0,
    rows: int = SAMPLE_ROWS,
) -> DataLengths:
    """Process the sampled rows exactly as ``dhp data check`` does and keep each row's LLM tokens,
    encoder patches and media items. Bad rows are left out of the counts; DataError when none of
    the sampled rows can be processed, or the source cannot be built (ConfigError, DataError)."""
    source, sizes, weights = build_source(
        data=data, model=model, vision_seq_len=vision_seq_len, llm_seq_len=llm_seq_len, seed=seed
    )
    picks, total = sample_indices(sizes, weights, seed=seed, rows=rows)
    with ThreadPoolExecutor(max(1, data.num_workers)) as pool:
        loaded = list(pool.map(lambda i: load_or_bad(source, i), picks))
    good = [s for s in loaded if not isinstance(s, BadSampleError)]
    if not good:
        first = next((s for s in loaded if isinstance(s, BadSampleError)), None)
        raise DataError(
            f"none of the {len(picks)} sampled rows could be processed" + (f": {first}" if first else "")
        )
    return DataLengths(
        rows=len(good),
        of_rows=total,
        tokens=sorted(s.num_tokens for s in good),
        patches=sorted(s.num_patches for s in good),
        media=sum(s.num_images for s in good),
    )


def _files(path: str, key: str) -> list[list]:
    """[resolved path, size, mtime_ns] of each file a dataset or model path names (a file, a folder
    itself, a glob's or a shard range's matches); DataError when it names nothing readable."""
    if "{" in path:
        found = expand_shards(path)
    elif any(c in path for c in "*?["):
        found = [Path(p) for p in sorted(glob.glob(path))]
    else:
        found = [resolve_path(path, key=key)]
    out = []
    try:
        for f in found:
            st = f.stat()
            out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    except OSError as e:
        raise DataError(f"{key} = {path!r}: cannot read it ({e.strerror or e}). Fix: correct the path") from e
    if not out:
        raise DataError(f"{key} = {path!r}: matches no file. Fix: correct the path")
    return out


def cache_key(
    *, data: DataConfig, model: ModelConfig, vision_seq_len: int, llm_seq_len: int, seed: int, rows: int
) -> str:
    """A hash of everything the counts depend on: the data settings (not ``lengths`` itself), the
    model's tokenizer and processor directory, the limits, the sample, and each dataset file's
    path, size and modification time. DataError when a dataset path cannot be read."""
    settings = OmegaConf.to_container(OmegaConf.structured(data), resolve=True)
    settings.pop("lengths", None)
    files = [
        _files(str(resolve_info(e).path), f"data.datasets[{i}].path") for i, e in enumerate(data.datasets)
    ]
    if model.path:
        files.append(_files(str(model.path), "model.path"))
    ident = {
        "version": CACHE_VERSION,
        "data": settings,
        "files": files,
        "family": str(model.family),
        "tokens": OmegaConf.to_container(OmegaConf.structured(model.tokens), resolve=True),
        "limits": [vision_seq_len, llm_seq_len],
        "sample": [seed, rows],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_path(key: str) -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dhp")
    return root / "data_lengths" / f"{key}.json"


def cached_lengths(
    *,
    data: DataConfig,
    model: ModelConfig,
    vision_seq_len: int,
    llm_seq_len: int,
    seed: int = 0,
    rows: int = SAMPLE_ROWS,
) -> DataLengths:
    """:func:`measure_lengths`, read from the cache when nothing it depends on changed."""
    args = dict(
        data=data, model=model, vision_seq_len=vision_seq_len, llm_seq_len=llm_seq_len, seed=seed, rows=rows
    )
    path = cache_path(cache_key(**args))
    if path.is_file():
        try:
            return DataLengths(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            pass  # a damaged entry is measured again and rewritten
    lengths = measure_lengths(**args)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(OmegaConf.to_container(OmegaConf.structured(lengths))))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs the next plan the measurement
    return lengths


def with_data_lengths(config: DictConfig, *, warn: Callable[[str], None]) -> DictConfig:
    """``config`` with ``data.lengths`` measured (cached) for a real-data run; a synthetic run (its
    lengths are known) or a run without an LLM is returned as is. When the data cannot be read the
    lengths stay unmeasured, ``note`` holds the reason and ``warn`` is called with it: the estimate
    falls back to micro-batches filled to ``seq_len``, never silently."""
    if config.data.kind == "synthetic" or "llm" not in config.modules:
        return config
    mods = config.modules
    try:
        lengths = cached_lengths(
            data=config.data,
            model=config.model,
            vision_seq_len=int(mods.vision.seq_len) if "vision" in mods else 0,
            llm_seq_len=int(mods.llm.seq_len),
            seed=int(config.train.seed),
        )
    except (DhpError, OSError, ValueError) as e:
        reason = " ".join(str(e).split())
        lengths = DataLengths(note=reason)
        warn(
            f"data lengths not measured: {reason}\n"
            "  the step-time estimate fills every micro-batch to modules.<m>.seq_len instead"
        )
    out = config.copy()
    OmegaConf.set_readonly(out, False)
    out.data.lengths = OmegaConf.structured(lengths)
    OmegaConf.set_readonly(out, OmegaConf.is_readonly(config))
    return out
