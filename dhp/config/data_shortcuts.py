"""Pointing a run at your own data in one argument: ``data=PATH.yaml`` and ``data.path=FILE``.

- ``data=path/to/my_data.yaml`` (any value ending in ``.yaml``/``.yml`` or holding a ``/``) picks that
  file as the ``data`` group option, exactly as ``data=demo`` picks ``conf/data/demo.yaml``: it is
  copied under a temporary search-path folder for the one composition.
- ``data.path=FILE`` (with ``data.format=``, default ``auto``) stands for
  ``data.datasets=[{name: <file stem>, path: FILE, format: ...}]`` and ``data.kind=llava``.
- Real data on a tiny test model (``model.tiny``) with no ``model.path``: ``model.path`` becomes the
  family's tiny checkpoint in the cache (:func:`tiny_checkpoint_dir`), which
  ``dhp.models.tiny_cache.ensure_tiny_checkpoint`` writes before the run reads it and names on the
  console. Any other model given real data without ``model.path`` is refused when the data is built.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dhp.config.schema import DataConfig, DatasetEntry
from dhp.errors import ConfigError, ConfigIssue

USER_OPTION = "user_file"  # the group option name the file is composed under
CACHE_ENV = "DHP_CACHE_DIR"  # the cache root, as dhp.machine.cache reads it (default ~/.cache/dhp)
TINY_CHECKPOINT_SEED = 0  # the random weights' seed, as scripts/make_tiny_checkpoint.py's default
TINY_CHECKPOINT_FORMAT = 2  # bump when the writer's output changes, so old cache entries are not read


def data_file_override(overrides: list[str]) -> tuple[list[str], Path | None]:
    """``overrides`` with a ``data=<file>`` rewritten to a group option, and the temporary search-path
    folder holding it (None when there is no such override; the caller removes the folder)."""
    out, folder = [], None
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key != "data" or not (value.endswith((".yaml", ".yml")) or "/" in value):
            out.append(arg)
            continue
        path = Path(value).expanduser()
        if not path.is_file():
            raise ConfigError(
                [
                    ConfigIssue(
                        "data",
                        value,
                        f"file {path.resolve()} does not exist",
                        "pass a data group name (conf/data/) or the path of a data YAML file",
                    )
                ]
            )
        folder = Path(tempfile.mkdtemp(prefix="dhp-data-"))
        (folder / "data").mkdir()
        shutil.copyfile(path, folder / "data" / f"{USER_OPTION}.yaml")
        out.append(f"data={USER_OPTION}")
    return out, folder


def remove_folder(folder: Path | None) -> None:
    """Delete the temporary search-path folder of :func:`data_file_override`."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def expand_data_path(cfg: DictConfig) -> None:
    """``data.path`` -> a one-dataset ``data.datasets`` (and ``data.kind=llava``), in place."""
    data = cfg.data
    if not data.path:
        return
    name = Path(str(data.path).rstrip("/")).stem.split(".")[0] or "data"
    entry = OmegaConf.structured(DatasetEntry(name=name, path=str(data.path), format=str(data.format)))
    data.datasets = [entry]
    data.kind = "llava"


def bare_data_config(overrides: list[str]):
    """A ``DataConfig`` from ``data.*`` overrides alone (``dhp data check`` without a recipe):
    ``data.path=FILE`` or ``data.datasets=[...]`` plus any other ``data.`` key. ConfigError for any
    other key (those need a recipe)."""

    dots, issues = [], []
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key.startswith("data."):
            dots.append(f"{key[len('data.') :]}={value}")
        else:
            issues.append(
                ConfigIssue(
                    key,
                    value,
                    "without conf= only data.* keys are read",
                    "add conf=RECIPE for token counts and model keys",
                )
            )
    if issues:
        raise ConfigError(issues)
    try:
        data = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.from_dotlist(dots))
    except Exception as e:  # OmegaConf raises several types for a bad key or value
        raise ConfigError(
            [ConfigIssue("data", " ".join(overrides), str(e).splitlines()[0], "fix the key")]
        ) from None
    wrapped = OmegaConf.create({"data": data})
    expand_data_path(wrapped)
    if not wrapped.data.datasets:
        raise ConfigError(
            [ConfigIssue("data.path", "", "no dataset given", "pass data.path=FILE (or conf=RECIPE)")]
        )
    return wrapped.data


def tiny_checkpoint_dir(model: DictConfig) -> Path:
    """Where the tiny checkpoint of ``model``'s numbers lives: ``$DHP_CACHE_DIR/tiny_checkpoints/
    <family>-<digest>``; the digest covers every number the writer reads (family, dtype, vision,
    llm, tokens, and the audio encoder's when the model has one), the seed and the format, so an
    overridden architecture gets its own directory."""
    keys = ("family", "dtype", "vision", "llm", "tokens")
    if "audio" in model and model.audio.depth > 0:
        keys += ("audio",)
    numbers = {
        key: OmegaConf.to_container(model[key], resolve=True)
        if OmegaConf.is_config(model[key])
        else model[key]
        for key in keys
    }
    numbers.update(seed=TINY_CHECKPOINT_SEED, format=TINY_CHECKPOINT_FORMAT)
    digest = hashlib.sha256(json.dumps(numbers, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dhp")
    return root / "tiny_checkpoints" / f"{model.family}-{digest}"


def use_tiny_checkpoint(cfg: DictConfig) -> None:
    """Real data on a tiny test model with no ``model.path``: point it at the tiny checkpoint, in place.

    Synthetic data keeps ``model.path=null`` (seeded random init, no tokenizer), and a model that is
    not ``tiny`` keeps it too (real data then needs the user's own directory)."""
    if cfg.data.kind == "llava" and cfg.model.path is None and cfg.model.tiny:
        cfg.model.path = str(tiny_checkpoint_dir(cfg.model))


def is_pending_tiny_checkpoint(model: DictConfig) -> bool:
    """``model.path`` is this model's tiny checkpoint and has not been written yet (the run writes it
    from these same numbers, so its config.json cannot disagree with them)."""
    if not model.tiny or model.path is None:
        return False
    path = Path(str(model.path))
    return path == tiny_checkpoint_dir(model) and not (path / "config.json").is_file()
