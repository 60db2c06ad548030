"""The rows start-up samples: processed once, before Ray, for the run's checks and the step-time estimate.

A real-data micro-batch is as long as its samples: the loader right-pads the LLM rows to the longest
sample of the micro-batch and concatenates the samples' patches (``dhp.data.batch.collate``), so a
plan that times micro-batches filled to ``modules.<m>.seq_len`` can be several times slow on data
much shorter than its bound. :func:`cached_rows` processes a bounded, deterministic sample of the
configured datasets with the same source, record validation and processing as the loader and
``dhp data check`` (``build_source``: records read, images decoded and processed, videos sampled,
conversations tokenized), without the per-sample limits, and keeps one :class:`SampledRow` per row:
its counts, or why it is a bad sample. The start-up checks (``dhp.data.preflight``) compare those
rows with the run's limits (:meth:`~dhp.data.processing.Limits.broken`, the loader's own rule), and
:func:`lengths_of` turns the rows that pass into ``data.lengths``, which the planner reads
(``dhp.plan.estimate.timing_shapes``, ``dhp.plan.workload``). Nothing here starts Ray.

Sample: at most :data:`SAMPLE_ROWS` rows spread evenly over one unshuffled epoch (each dataset
repeated by its weight, ``epoch_order``), the same rows on every call. Results are cached under
``$DHP_CACHE_DIR/data_lengths/`` by the datasets' files (paths, sizes, modification times; a
folder's own, which a file added or removed changes), the model directory's files and every setting
the counts depend on; a changed file or setting measures again. A changed ``seq_len`` does not: the
rows are measured without limits.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import itertools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dhp.config.schema import DataConfig, DataLengths, ModelConfig
from dhp.data.bad import BadSampleError
from dhp.data.batch import VIDEO, Sample
from dhp.data.check import load_or_bad
from dhp.data.dataset_info import resolve_info
from dhp.data.llava import resolve_path
from dhp.data.processing import UNBOUNDED, Limits
from dhp.data.source import build_source, epoch_order
from dhp.data.wds import expand_shards
from dhp.errors import DataError

#: rows measured at most (the demo set's 25 all fit; a large set costs ~SAMPLE_ROWS samples' processing)
SAMPLE_ROWS = 64
CACHE_ENV = "DHP_CACHE_DIR"  # the cache root, as dhp.machine.cache reads it (default ~/.cache/dhp)
CACHE_VERSION = 2  # bump when what is measured changes


@dataclass(frozen=True)
class SampledRow:
    """One sampled row as the loader would process it. ``bad``: ``(reason, detail, fix)`` of a bad
    sample (the counts are then 0); ``items``: per image or video in token order,
    ``[kind, patches, frames]`` (kind ``image`` or ``video``; frames 1 for an image)."""

    location: str
    dataset: int  # index into data.datasets
    bad: tuple[str, str, str] | None = None
    tokens: int = 0
    patches: int = 0
    image_tokens: int = 0
    video_tokens: int = 0
    items: tuple[tuple[str, int, int], ...] = field(default_factory=tuple)

    @property
    def images(self) -> int:
        return sum(1 for kind, _, _ in self.items if kind == "image")

    @property
    def videos(self) -> int:
        return sum(1 for kind, _, _ in self.items if kind == "video")

    @property
    def frames(self) -> int:
        """Video frames of the row (sampled frames, every video)."""
        return sum(f for kind, _, f in self.items if kind == "video")


def row_of(sample: Sample | BadSampleError, *, location: str, dataset: int, temporal: int) -> SampledRow:
    """The :class:`SampledRow` of a processed sample (or of its bad-sample error); ``temporal``:
    frames per temporal patch (a video item of grid ``(t, h, w)`` sampled ``t * temporal`` frames)."""
    if isinstance(sample, BadSampleError):
        return SampledRow(location, dataset, bad=(sample.reason, sample.detail, sample.fix))
    grids = [] if sample.image_grid_thw is None else sample.image_grid_thw.tolist()
    runs = [k for k, _ in itertools.groupby(sample.mm_token_type_ids.tolist()) if k != 0]
    items = tuple(
        ("video", t * h * w, t * temporal) if kind == VIDEO else ("image", t * h * w, 1)
        for kind, (t, h, w) in zip(runs, grids, strict=True)
    )
    return SampledRow(
        location,
        dataset,
        tokens=sample.num_tokens,
        patches=sample.num_patches,
        image_tokens=sample.num_image_tokens,
        video_tokens=sample.num_video_tokens,
        items=items,
    )


def sample_indices(sizes: list[int], weights: list[float], *, seed: int, rows: int) -> tuple[list[int], int]:
    """(global indices of at most ``rows`` rows spread evenly over one unshuffled epoch, the epoch's
    length). Deterministic: the same datasets, weights and seed give the same rows."""
    order = epoch_order(sizes=sizes, weights=weights, seed=seed, epoch=0, shuffle=False)
    n = len(order)
    if n <= rows:
        return order, n
    return [order[i * n // rows] for i in range(rows)], n


def measure_rows(
    *, data: DataConfig, model: ModelConfig, seed: int = 0, rows: int = SAMPLE_ROWS
) -> tuple[list[SampledRow], int]:
    """(the sampled rows, processed as the loader does but without per-sample limits, one epoch's
    length). ConfigError or DataError when the source cannot be built (a tokenizer, a processor or
    a dataset file that cannot be read)."""
    source, sizes, weights = build_source(
        data=data,
        model=model,
        patch_seq_len=UNBOUNDED.patch_seq_len,
        token_seq_len=UNBOUNDED.token_seq_len,
        seed=seed,
    )
    picks, total = sample_indices(sizes, weights, seed=seed, rows=rows)
    with ThreadPoolExecutor(max(1, data.num_workers)) as pool:
        loaded = list(pool.map(lambda i: load_or_bad(source, i), picks))
    starts = [sum(sizes[:d]) for d in range(len(sizes))]
    temporal = max(int(model.vision.temporal_patch_size), 1)
    out = [
        row_of(s, location=source.location(i), dataset=bisect.bisect_right(starts, i) - 1, temporal=temporal)
        for i, s in zip(picks, loaded, strict=True)
    ]
    return out, total


def lengths_of(rows: list[SampledRow], *, of_rows: int, limits: Limits) -> DataLengths:
    """``data.lengths`` of the rows the run would train: neither bad nor over ``limits``."""
    good = [r for r in rows if r.bad is None and not limits.broken(patches=r.patches, tokens=r.tokens)]
    return DataLengths(
        rows=len(good),
        of_rows=of_rows,
        tokens=sorted(r.tokens for r in good),
        patches=sorted(r.patches for r in good),
        media=sum(len(r.items) for r in good),
        videos=sum(r.videos for r in good),
        video_frames=sum(r.frames for r in good),
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
        if found[0].is_dir() and key == "model.path":  # its files: a rewritten tokenizer measures again
            found = sorted(p for p in found[0].iterdir() if p.is_file())
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


def cache_key(*, data: DataConfig, model: ModelConfig, seed: int, rows: int) -> str:
    """A hash of everything the rows depend on: the data settings (not ``lengths`` itself), the
    model's numbers and directory, the sample, and each dataset file's path, size and modification
    time. DataError when a dataset path cannot be read."""
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
        "vision": OmegaConf.to_container(OmegaConf.structured(model.vision), resolve=True),
        "tokens": OmegaConf.to_container(OmegaConf.structured(model.tokens), resolve=True),
        "sample": [seed, rows],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_path(key: str) -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dhp")
    return root / "data_lengths" / f"{key}.json"


def _from_json(doc: dict) -> tuple[list[SampledRow], int]:
    rows = [
        SampledRow(
            **{
                **r,
                "bad": tuple(r["bad"]) if r["bad"] else None,
                "items": tuple(tuple(i) for i in r["items"]),
            }
        )
        for r in doc["rows"]
    ]
    return rows, int(doc["of_rows"])


def cached_rows(
    *, data: DataConfig, model: ModelConfig, seed: int = 0, rows: int = SAMPLE_ROWS
) -> tuple[list[SampledRow], int]:
    """:func:`measure_rows`, read from the cache when nothing it depends on changed."""
    path = cache_path(cache_key(data=data, model=model, seed=seed, rows=rows))
    if path.is_file():
        try:
            return _from_json(json.loads(path.read_text()))
        except (ValueError, TypeError, KeyError):
            pass  # a damaged entry is measured again and rewritten
    sampled, total = measure_rows(data=data, model=model, seed=seed, rows=rows)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"rows": [asdict(r) for r in sampled], "of_rows": total}))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs the next start the measurement
    return sampled, total


def cached_lengths(
    *,
    data: DataConfig,
    model: ModelConfig,
    patch_seq_len: int,
    token_seq_len: int,
    seed: int = 0,
    rows: int = SAMPLE_ROWS,
) -> DataLengths:
    """``data.lengths`` of the cached rows under these limits (:func:`cached_rows`, :func:`lengths_of`)."""
    sampled, total = cached_rows(data=data, model=model, seed=seed, rows=rows)
    return lengths_of(sampled, of_rows=total, limits=Limits.of(model.family, patch_seq_len, token_seq_len))


def with_lengths(config: DictConfig, lengths: DataLengths) -> DictConfig:
    """A copy of ``config`` with ``data.lengths`` set (read-only when ``config`` is)."""
    out = config.copy()
    OmegaConf.set_readonly(out, False)
    out.data.lengths = OmegaConf.structured(lengths)
    OmegaConf.set_readonly(out, OmegaConf.is_readonly(config))
    return out
