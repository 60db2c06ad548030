"""Pointing a run at your own data in one argument: ``data=PATH.yaml`` and ``data.path=FILE``.

- ``data=path/to/my_data.yaml`` (any value ending in ``.yaml``/``.yml`` or holding a ``/``) picks that
  file as the ``data`` group option, exactly as ``data=demo`` picks ``conf/data/demo.yaml``: it is
  copied under a temporary search-path folder for the one composition.
- ``data.path=FILE`` (with ``data.format=``, default ``auto``) stands for
  ``data.datasets=[{name: <file stem>, path: FILE, format: ...}]`` and ``data.kind=llava``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dhp.config.schema import DataConfig, DatasetEntry
from dhp.errors import ConfigError, ConfigIssue

USER_OPTION = "user_file"  # the group option name the file is composed under


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
