"""What the data of a run must pass before any process starts: the checks ``dhp plan`` and ``dhp train``
share (:func:`check_run_data`, called by ``dhp.runtime.launch.preflight``), every problem collected.

- every dataset's ``path`` names something (a file, a folder, or a glob / brace range with at least one
  match) and every ``image_root`` is a folder, ``data.eval.path`` and its ``image_root`` too
  (:func:`data_path_issues`);
- the model directory's tokenizer and image processor load, and the datasets open (``build_source``);
- the rows start-up samples (``dhp.data.lengths``: up to ``SAMPLE_ROWS``, the rows the step-time
  estimate measures) pass the loader's record validation: a bad one is named by ``file:line``, reason
  and fix;
- the sampled rows keep the per-sample limits (:meth:`~dhp.data.processing.Limits.broken`, the
  loader's rule): for each limit broken, the longest row breaking it and what would make it fit
  (the image encoder's ``seq_len`` against its patches, the consumer's against its tokens, with
  the ``data.max_pixels`` / ``data.video_max_frames`` / ``data.video_max_pixels`` that would bring it
  under).

Under ``data.on_bad_sample=raise`` (the default) a bad or over-limit row is an issue, since the run
would stop on it; under ``skip`` it is a warning (the run skips and counts it), and only a sample of
which no row can be trained is an issue.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass, field

from omegaconf import DictConfig

from dhp.config.schema import DataConfig, DataLengths
from dhp.data import bad
from dhp.data.dataset_info import resolve_info
from dhp.data.lengths import SAMPLE_ROWS, SampledRow, cached_rows, lengths_of
from dhp.data.llava import resolve_path
from dhp.data.processing import Limits, load_tokenizer
from dhp.data.wds import expand_shards
from dhp.errors import ConfigError, ConfigIssue, DataError, DhpError
from dhp.models.graph import consumer_name, image_module, seq_limits

LISTED_BAD_ROWS = 8  # bad sampled rows named one by one; the rest are counted (`dhp data check` lists all)


@dataclass
class DataChecks:
    """What :func:`check_run_data` found: ``issues`` stop the run, ``warnings`` are said and the run
    goes on; ``lengths``: the sampled rows the run would train (None: synthetic data, or not read)."""

    issues: list[ConfigIssue] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    lengths: DataLengths | None = None


def _exists(path: str) -> bool:
    if "{" in path:
        shards = expand_shards(path)
        return bool(shards) and all(s.is_file() for s in shards)
    if any(c in path for c in "*?["):
        return bool(glob.glob(path))
    return resolve_path(path, key="data.datasets[].path").exists()


def data_path_issues(data: DataConfig) -> list[ConfigIssue]:
    """One issue per dataset file or image root that does not exist (empty: all there)."""
    if data.kind != "llava":
        return []
    issues = []
    for i, raw in enumerate(data.datasets):
        try:
            entry = resolve_info(raw)
        except ConfigError as e:
            issues += e.issues
            continue
        if not _exists(entry.path):
            issues.append(
                ConfigIssue(
                    f"data.datasets.{i}.path",
                    entry.path,
                    f"does not exist (dataset {entry.name})",
                    "correct the path, or mount the shared storage it lives on (docs/DATA.md)",
                )
            )
        root = entry.image_root or entry.media_dir
        if root and not resolve_path(root, key="image_root").is_dir():
            issues.append(
                ConfigIssue(
                    f"data.datasets.{i}.image_root",
                    root,
                    f"is not a directory (dataset {entry.name})",
                    "point image_root at the folder the records' relative media paths start from",
                )
            )
    return issues + _eval_path_issues(data)


def _eval_path_issues(data: DataConfig) -> list[ConfigIssue]:
    """The evaluation file (``data.eval.path``) and its image root, when given, exist."""
    ev = data.eval
    issues = []
    if ev.path and not _exists(ev.path):
        issues.append(
            ConfigIssue(
                "data.eval.path",
                ev.path,
                "does not exist (the evaluation file)",
                "correct the path, or hold out a share of the training data instead: "
                "data.eval.path='' data.eval.split=0.02",
            )
        )
    if ev.path and ev.image_root and not resolve_path(ev.image_root, key="image_root").is_dir():
        issues.append(
            ConfigIssue(
                "data.eval.image_root",
                ev.image_root,
                "is not a directory",
                "point it at the folder the eval records' relative media paths start from",
            )
        )
    return issues


def missing_data_paths(data: DataConfig) -> list[str]:
    """One line per dataset file or image root that does not exist (empty: all there)."""
    return [str(i) for i in data_path_issues(data)]


def check_data_paths(data: DataConfig) -> None:
    """Raise DataError listing every missing dataset path and image root (see :func:`missing_data_paths`)."""
    problems = missing_data_paths(data)
    if problems:
        lines = "\n  ".join(problems)
        raise DataError(f"the configured data is not reachable from this machine:\n  {lines}")


def _error_issues(err: DhpError) -> list[ConfigIssue]:
    if isinstance(err, ConfigError):
        return list(err.issues)
    return [ConfigIssue("data", None, " ".join(str(err).split()), "")]  # a DataError says its own fix


def check_run_data(cfg: DictConfig, *, read_rows: bool = True, rows: int = SAMPLE_ROWS) -> DataChecks:
    """Every data problem of run config ``cfg`` that the run would meet before or at its sampled
    rows (module docstring). ``read_rows`` False (the model did not pass validation): only the data
    files' existence. Real data needs ``cfg.model.path`` (validation says so; nothing is read here)."""
    model, data = cfg.model, cfg.data
    if data.kind != "llava":  # synthetic: only a model directory's tokenizer is read
        if not read_rows or model.path is None:
            return DataChecks()
        try:
            load_tokenizer(str(model.path), tokens=model.tokens, family=model.family)
        except DhpError as e:
            return DataChecks(issues=_error_issues(e))
        return DataChecks()
    out = DataChecks(issues=data_path_issues(data))
    if out.issues or not read_rows or model.path is None:
        return out
    try:
        sampled, total = cached_rows(data=data, model=model, seed=int(cfg.train.seed), rows=rows)
    except DhpError as e:
        out.issues += _error_issues(e)
        return out
    limits = Limits.of(cfg.model.family, *seq_limits(cfg.model.family, cfg.modules))
    found = bad_row_issues(sampled) + limit_issues(sampled, cfg=cfg, limits=limits)
    out.lengths = lengths_of(sampled, of_rows=total, limits=limits)
    if data.on_bad_sample == "raise":
        out.issues += found
    elif found:
        out.warnings.append(
            "data.on_bad_sample=skip: among the sampled rows, the run will skip:\n  "
            + "\n  ".join(str(i) for i in found)
        )
    if found and out.lengths.rows == 0 and data.on_bad_sample != "raise":  # raise: the rows above stop it
        out.issues.append(
            ConfigIssue(
                "data.datasets",
                f"{len(sampled)} sampled rows",
                "none of the sampled rows can be trained (each is bad or over a limit, above)",
                "fix the rows or the limits above; `dhp data check` scans every row",
            )
        )
    return out


def bad_row_issues(sampled: list[SampledRow]) -> list[ConfigIssue]:
    """One issue per bad sampled row (the first :data:`LISTED_BAD_ROWS`, then a count)."""
    rows = [r for r in sampled if r.bad is not None]
    issues = [
        ConfigIssue(
            f"data.datasets.{r.dataset}",
            r.location,
            f"a sampled row is a bad sample ({r.bad[0]}): {r.bad[1]}",
            f"{r.bad[2]}; or set data.on_bad_sample=skip to skip and count such rows",
        )
        for r in rows[:LISTED_BAD_ROWS]
    ]
    if len(rows) > LISTED_BAD_ROWS:
        reasons = sorted({r.bad[0] for r in rows[LISTED_BAD_ROWS:]})
        issues.append(
            ConfigIssue(
                "data.datasets",
                f"{len(rows) - LISTED_BAD_ROWS} more rows",
                f"more sampled rows are bad samples ({', '.join(reasons)})",
                "`dhp data check conf=... data...` lists every bad row by reason",
            )
        )
    return issues


def _items(row: SampledRow) -> str:
    parts = [f"image {p}" if kind == "image" else f"video {p} from {f} frames" for kind, p, f in row.items]
    return ", ".join(parts) or "no image"


def limit_issues(sampled: list[SampledRow], *, cfg: DictConfig, limits: Limits) -> list[ConfigIssue]:
    """For each per-sample limit some good sampled row breaks: the longest such row, every knob that
    would make it fit, and how many sampled rows break it."""
    good = [r for r in sampled if r.bad is None]
    over = {
        reason: [r for r in good if reason in limits.broken(patches=r.patches, tokens=r.tokens)]
        for reason in (bad.VISION_TOO_LONG, bad.TEXT_TOO_LONG)
    }
    issues = []
    if over[bad.VISION_TOO_LONG]:
        issues.append(_patches_issue(over[bad.VISION_TOO_LONG], n=len(sampled), cfg=cfg, limits=limits))
    if over[bad.TEXT_TOO_LONG]:
        issues.append(_tokens_issue(over[bad.TEXT_TOO_LONG], n=len(sampled), cfg=cfg, limits=limits))
    return issues


def _patches_issue(rows: list[SampledRow], *, n: int, cfg: DictConfig, limits: Limits) -> ConfigIssue:
    """Sampled rows over the image encoder's ``seq_len``, with the knobs that bring them under it."""
    row = max(rows, key=lambda r: r.patches)
    seq, micro = limits.patch_seq_len, int(cfg.train.micro_batch_size)
    key = f"modules.{image_module(cfg.model.family)}.seq_len"
    knobs = [f"raise {key} to at least {row.patches}"]
    if micro > 1:
        knobs[0] += f" ({row.patches * micro} for a micro-batch of {micro} such rows)"
    image_patches = sum(p for kind, p, _ in row.items if kind == "image")
    video_patches = row.patches - image_patches
    v = cfg.model.vision
    if row.images and seq > video_patches:  # the images' share of the limit, at the same aspect
        per_image = (seq - video_patches) / row.images
        knobs.append(f"lower data.max_pixels to about {int(per_image) * v.patch_size**2}")
    if row.videos:
        temporal = max(int(v.temporal_patch_size), 1)
        per_step = video_patches / max(row.frames // temporal, 1)  # patches of one temporal patch, all videos
        steps = int((seq - image_patches) // per_step) if per_step else 0
        if steps >= 1:
            knobs.append(
                f"lower data.video_max_frames to {steps * temporal} (now {cfg.data.video_max_frames})"
            )
        knobs.append(f"lower data.video_max_pixels (now {cfg.data.video_max_pixels})")
    return ConfigIssue(
        key,
        seq,
        f"{len(rows)} of the {n} sampled rows have more encoder patches than it; the longest, "
        f"{row.location}, has {row.patches} ({_items(row)})",
        ", or ".join(knobs),
    )


def _tokens_issue(rows: list[SampledRow], *, n: int, cfg: DictConfig, limits: Limits) -> ConfigIssue:
    """Sampled rows over the consumer's ``seq_len``, with the knobs that bring them under it."""
    row = max(rows, key=lambda r: r.tokens)
    text = row.tokens - row.image_tokens - row.video_tokens
    key = f"modules.{consumer_name(cfg.model.family)}.seq_len"
    knobs = [f"raise {key} to at least {row.tokens}"]
    if row.image_tokens:
        knobs.append("lower data.max_pixels")
    if row.video_tokens:
        knobs.append("lower data.video_max_frames")
    knobs.append("shorten the conversation")
    return ConfigIssue(
        key,
        limits.token_seq_len,
        f"{len(rows)} of the {n} sampled rows have more LLM tokens than it; the longest, {row.location}, "
        f"has {row.tokens} ({row.image_tokens} image, {row.video_tokens} video, {text} text)",
        ", or ".join(knobs),
    )


__all__ = ["DataChecks", "check_data_paths", "check_run_data", "data_path_issues", "missing_data_paths"]
