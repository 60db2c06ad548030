"""Compose a run config with Hydra (validation and freezing: ``dhp.validation.load_config``).

``conf=`` names a recipe in ``recipes/`` or a path to a user's YAML. ``conf/`` (the config groups
``model/``, ``cluster/``, ``parallel/``, ``data/``, ``train/``) is on the search path, so a recipe's
defaults list picks group options (``- /model: tiny``) and every other CLI argument is a
Hydra override (``modules.vision.parallel.sp=4``, ``model=tiny``).

The composed config is typed by :class:`~dhp.config.schema.RunConfig` in struct mode: an unknown
key, a wrong type or an unknown recipe/group option becomes a :class:`~dhp.errors.ConfigError`
naming the key path, never a Hydra traceback. Nothing here starts a process or touches a device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, is_dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from dhp.config.data_shortcuts import (
    data_file_override,
    expand_data_path,
    remove_folder,
    use_tiny_checkpoint,
)
from dhp.config.hydra_errors import to_config_error
from dhp.config.keys import did_you_mean, override_key_issues
from dhp.config.schema import RunConfig
from dhp.config.smoke import smoke_config
from dhp.errors import ConfigError, ConfigIssue

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"
RECIPES_DIR = REPO_ROOT / "recipes"

_SCHEMA_NAME = "_dhp_schema"
_PRIMARY_NAME = "_dhp_primary"


def list_recipes() -> list[tuple[str, str]]:
    """Return ``(name, description)`` for every recipe in ``recipes/``, sorted by name."""
    out = []
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        raw = OmegaConf.load(path)
        desc = OmegaConf.select(raw, "description", default="")  # a recipe may omit it
        out.append((path.stem, str(desc)))
    return out


def resolve_conf(conf: str) -> tuple[Path, str]:
    """Map ``conf=`` to ``(directory to search, config name)``.

    A bare name is a recipe in ``recipes/``; anything ending in ``.yaml``/``.yml`` or containing a
    path separator is a user's file. Raises ConfigError (key ``conf``) when neither exists.
    """
    if not conf:
        raise ConfigError([_conf_issue(conf, "conf= is required")])
    is_path = conf.endswith((".yaml", ".yml")) or "/" in conf
    if is_path:
        path = Path(conf).expanduser().resolve()
        if not path.is_file():
            raise ConfigError([_conf_issue(conf, f"file {path} does not exist")])
        return path.parent, path.stem
    if not (RECIPES_DIR / f"{conf}.yaml").is_file():
        raise ConfigError([_conf_issue(conf, "no such recipe in recipes/")])
    return RECIPES_DIR, conf


def _conf_issue(conf: str, rule: str) -> ConfigIssue:
    names = ", ".join(name for name, _ in list_recipes())
    return ConfigIssue(
        path="conf",
        value=conf,
        rule=rule,
        fix=f"pass a recipe name ({names}) or a path to a YAML file; `dhp recipes` lists them",
    )


def compose_config(conf: str, overrides: list[str]) -> DictConfig:
    """Compose ``conf`` + ``overrides`` onto the RunConfig schema; no validation, not frozen.

    Missing mandatory values (``???``) are left in place for :func:`validate` to report.
    """
    search_dir, name = resolve_conf(conf)
    overrides, data_dir = data_file_override(list(overrides))
    mistyped = override_key_issues(overrides)
    if mistyped:  # every mistyped key at once (Hydra would stop at the first)
        remove_folder(data_dir)
        raise ConfigError(mistyped)
    searchpath = [f"file://{search_dir}"] + ([f"file://{data_dir}"] if data_dir else [])
    store = ConfigStore.instance()
    _store_schema(store)
    store.store(
        name=_PRIMARY_NAME,
        node={
            "defaults": [_SCHEMA_NAME, name, "_self_"],
            "hydra": {"searchpath": searchpath},
        },
    )
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=_PRIMARY_NAME, overrides=list(overrides))
    except Exception as exc:  # Hydra/OmegaConf raise many types; all become ConfigError
        raise to_config_error(exc, conf=conf, overrides=overrides) from None
    finally:
        GlobalHydra.instance().clear()
        remove_folder(data_dir)
    if "hydra" in cfg:
        with _writable(cfg):
            del cfg["hydra"]
    cfg = _retype(cfg, conf=conf, overrides=overrides)
    expand_data_path(cfg)
    return cfg


def _retype(cfg: DictConfig, *, conf: str, overrides: list[str]) -> DictConfig:
    """Reject keys the schema does not know. Hydra's ``+key=value`` appends even in struct mode,
    so an unknown key added that way is caught here, with its key path, not carried silently."""
    unknown = sorted(_unknown_keys(cfg, prefix=""))
    if unknown:
        raise ConfigError(
            [
                ConfigIssue(
                    path=path,
                    value=OmegaConf.select(cfg, path),
                    rule=f"this key is not in the schema (dhp/config/schema.py){did_you_mean(path)}",
                    fix="remove it or fix its spelling; `+key=value` cannot add new settings",
                )
                for path in unknown
            ]
        )
    return cfg


def _unknown_keys(node: DictConfig, *, prefix: str) -> list[str]:
    """Dotted paths of keys under ``node`` that its dataclass type does not declare."""
    typ = OmegaConf.get_type(node)
    allowed = {f.name for f in fields(typ)} if is_dataclass(typ) else None
    out = []
    for key in node:
        path = f"{prefix}{key}"
        if allowed is not None and key not in allowed:
            out.append(path)
        elif not OmegaConf.is_missing(node, key) and isinstance(node[key], DictConfig):
            out += _unknown_keys(node[key], prefix=f"{path}.")
    return out


class _writable:
    """Context manager: temporarily lift struct mode to delete Hydra's own node."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg

    def __enter__(self) -> DictConfig:
        OmegaConf.set_struct(self.cfg, False)
        return self.cfg

    def __exit__(self, *exc: object) -> None:
        OmegaConf.set_struct(self.cfg, True)


def _store_schema(store: ConfigStore) -> None:
    """Register the schema once per process: turning the dataclasses into a config node is the
    costliest part of a compose, and the node never changes."""
    if _SCHEMA_NAME + ".yaml" not in store.repo:
        store.store(name=_SCHEMA_NAME, node=RunConfig)


def _extra_keys(model: DictConfig) -> tuple[list[str], list[str]]:
    """The names under ``model.vision.extra`` and ``model.llm.extra`` (a family flavour's own numbers)."""
    return tuple(  # type: ignore[return-value]
        sorted(model[part].extra) if part in model and "extra" in model[part] else []
        for part in ("vision", "llm")
    )


def _tiny_model_file(model: DictConfig):
    """The tiny model a smoke run of ``model`` shrinks to: among ``conf/model/tiny_<family>*.yaml`` of
    the same family, the one declaring the same ``extra`` keys (a family's flavour, e.g. its MoE one,
    keeps its own numbers: merged onto the recipe's model, a flavour's tiny numbers leave none of the
    full-size ones behind); else ``tiny_<family>.yaml``; else ``tiny.yaml``."""
    own = CONF_DIR / "model" / f"tiny_{model.family}.yaml"
    for path in sorted((CONF_DIR / "model").glob(f"tiny_{model.family}*.yaml")):
        tiny = OmegaConf.load(path)
        if tiny.family == model.family and _extra_keys(tiny) == _extra_keys(model):
            return path
    return own if own.is_file() else CONF_DIR / "model" / "tiny.yaml"


def compose_run(
    conf: str,
    overrides: list[str] | None = None,
    *,
    smoke: bool = False,
    consumer_of: Callable[[str], str | None] | None = None,
) -> DictConfig:
    """Compose a run config and (``smoke=True``) shrink it to a smoke run, not yet validated: what
    :func:`dhp.validation.load_config` validates and freezes. ``smoke`` applies
    :func:`dhp.config.smoke.smoke_config` (tiny model, local CPU cluster, degrees scaled to 2; a
    ``model.path=`` override is kept, with the real data). Real data
    on a tiny model without ``model.path`` names the tiny checkpoint
    (:func:`dhp.config.data_shortcuts.use_tiny_checkpoint`; the run writes it). ``consumer_of``: a
    family's name -> its loss module (``dhp.models.graph.known_consumer``), which ``smoke`` needs:
    the module graph is the families' and this layer sits below them."""
    cfg = compose_config(conf, list(overrides or []))
    if smoke:
        if consumer_of is None:
            raise ValueError("compose_run(smoke=True) needs consumer_of, the family's loss module")
        cfg = smoke_config(
            cfg,
            tiny_model=OmegaConf.load(_tiny_model_file(cfg.model)),
            local_cluster=OmegaConf.load(CONF_DIR / "cluster" / "local_cpu.yaml"),
            consumer=consumer_of(str(cfg.model.family)),
            # a model.path given here is a tiny checkpoint of the family: the smoke run reads it
            keep_model_path=any(o.partition("=")[0] == "model.path" for o in overrides or []),
        )
    use_tiny_checkpoint(cfg)
    return cfg
