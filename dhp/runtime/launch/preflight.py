"""Every check a run passes before any process starts, in one pass: what ``dhp plan`` and ``dhp train``
both call (:func:`checked_config`), so a plan that says "fits" is a run that starts.

In order, each problem collected and all of them raised as one ConfigError (exit 2, nothing started):

1. the composed config's validation (``dhp.validation.validate``: schema, family, plan space, cluster,
   data keys, ``model.path``'s files: config.json, weights, tokenizer with its chat template, the image
   processor for real data);
2. the configured trackers are reachable (``dhp.metrics.tracker_check``);
3. real data on a tiny model: its tiny checkpoint is written to the cache when missing
   (``dhp.models.tiny_cache``; only when the model's numbers passed, since the writer builds them);
4. the data (``dhp.data.preflight.check_run_data``): dataset files and image roots exist, the tokenizer
   and image processor load, the sampled rows pass the loader's record validation and the per-sample
   limits, each broken limit with the longest row and the knobs that make it fit.

The sampled rows' lengths go into ``data.lengths`` of the returned (frozen) config, for the plan's
step time and workload.

``worst_case`` (``dhp plan --worst-case``; never ``dhp train``): the plan of a recipe before its
user has the files, e.g. an SFT recipe that takes ``model.path`` and ``data.path``. The two problems
of the run's own inputs (a real-size model without ``model.path``, real data without a dataset) are
said, not raised, and no row is read: every micro-batch is filled to its ``seq_len``, the plan's
worst case. Every other problem is still raised.
"""

from __future__ import annotations

from collections.abc import Callable

from omegaconf import OmegaConf

from dhp.config.loader import compose_run
from dhp.config.schema import RunConfig
from dhp.errors import ConfigError, ConfigIssue


def _under(issues: list[ConfigIssue], *roots: str) -> bool:
    """Whether an issue sits at one of ``roots`` or below it (``data`` covers ``data.max_pixels``)."""
    return any(i.path == r or i.path.startswith(f"{r}.") for i in issues for r in roots)


def checked_config(
    conf: str,
    overrides: list[str] | None = None,
    *,
    smoke: bool = False,
    say: Callable[[str], None],
    worst_case: bool = False,
) -> RunConfig:
    """Compose ``conf`` with ``overrides`` (``smoke``: shrunk to a tiny CPU run) and run every check
    of the module docstring; returns the config frozen, with ``data.lengths`` measured for real data.
    ``say`` gets the lines worth a user's eye that are not problems (the tiny checkpoint used, rows a
    ``skip`` policy will skip). Raises one ConfigError with every problem found. ``worst_case``: see
    the module docstring."""
    # reason: the families' code, after the CLI's fast start
    from dhp.models.graph import known_consumer
    from dhp.validation.validate import is_missing_input, validate

    cfg = compose_run(conf, overrides, smoke=smoke, consumer_of=known_consumer)
    issues = list(validate(cfg))
    issues += _tracker_issues(cfg, issues)
    lengths = None
    if worst_case:
        _say_worst_case(cfg, [i for i in issues if is_missing_input(i)], say)
        issues = [i for i in issues if not is_missing_input(i)]
    has_data = cfg.data.kind != "llava" or bool(cfg.data.datasets)
    if has_data and not _under(issues, "data", "conf"):  # the data settings hold: their files can be
        # looked for and, with a model that passed (its numbers, its directory), its rows read
        read_rows = not worst_case and not _under(issues, "model")
        lengths = _data_checks(cfg, issues, read_rows=read_rows, say=say)
    if issues:
        raise ConfigError(_unique(issues))
    OmegaConf.resolve(cfg)
    if lengths is not None:
        OmegaConf.set_readonly(cfg, False)
        cfg.data.lengths = OmegaConf.structured(lengths)
    elif worst_case and cfg.data.kind != "synthetic":
        OmegaConf.set_readonly(cfg, False)
        cfg.data.lengths.note = "not read: --worst-case"  # the estimate line says so
    OmegaConf.set_readonly(cfg, True)
    return cfg  # type: ignore[return-value]  # a DictConfig typed by RunConfig


def _say_worst_case(cfg, inputs: list[ConfigIssue], say: Callable[[str], None]) -> None:
    """The line ``--worst-case`` prints: what the plan does without the data, what train will need."""
    if cfg.data.kind == "synthetic":
        line = "--worst-case: synthetic data: the plan uses its configured sample sizes"
    else:
        line = "--worst-case: every micro-batch filled to its seq_len; no data row is read"
    if inputs:
        need = "; ".join(f"{i.path}: {i.fix}" for i in inputs)
        line += f". dhp train needs what this plan went without: {need}"
    say(line)


def _tracker_issues(cfg, issues: list[ConfigIssue]) -> list[ConfigIssue]:
    """The trackers this machine cannot use now (only when the metrics keys themselves passed)."""
    if any(i.path.startswith("metrics") for i in issues):
        return []
    from dhp.metrics.tracker_check import check_trackers  # reason: sockets and netrc, for trackers only

    try:
        check_trackers(cfg.metrics)
    except ConfigError as e:
        return list(e.issues)
    return []


def _data_checks(cfg, issues: list[ConfigIssue], *, read_rows: bool, say: Callable[[str], None]):
    """Write a pending tiny checkpoint, then check the data (issues appended; ``read_rows`` False:
    only its files' existence); returns the sampled rows' lengths (None: synthetic, or not read)."""
    if cfg.data.kind == "synthetic" and (not read_rows or cfg.model.path is None):
        return None  # nothing to read: sizes and weights come from the config
    # reason: the data layer loads torch and the tokenizer's code, which a synthetic plan never needs
    from dhp.data.preflight import check_run_data
    from dhp.models.tiny_cache import ensure_tiny_checkpoint

    if read_rows:
        ensure_tiny_checkpoint(cfg.model, say=say)
    found = check_run_data(cfg, read_rows=read_rows)
    issues += found.issues
    for line in found.warnings:
        say(line)
    return found.lengths


def _unique(issues: list[ConfigIssue]) -> list[ConfigIssue]:
    """``issues`` without repeats (a rule the data checks meet again), in order."""
    seen, out = set(), []
    for i in issues:
        if str(i) not in seen:
            seen.add(str(i))
            out.append(i)
    return out
