"""``load_config``: compose a run config, validate all of it, and freeze it.

Validation asks the model family (its typed architecture, and for freeze/param-group/LoRA globs its
modules built on ``meta``), so it sits above ``dhp.models`` and ``dhp.parallel``; composition and the
schema stay in ``dhp.config`` below them.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from dhp.config.loader import compose_run
from dhp.config.schema import RunConfig
from dhp.models.graph import known_consumer
from dhp.validation.validate import raise_if_invalid


def load_config(conf: str, overrides: list[str] | None = None, *, smoke: bool = False) -> RunConfig:
    """Compose (:func:`dhp.config.loader.compose_run`; ``smoke=True`` shrinks any recipe to a tiny
    4-rank CPU run), validate, and freeze a run config.

    Returns an OmegaConf DictConfig typed as RunConfig: attribute access like the dataclass, struct mode
    (unknown keys raise) and read-only. Raises ConfigError listing every problem found; nothing has been
    started at that point.
    """
    cfg = compose_run(conf, overrides, smoke=smoke, consumer_of=known_consumer)
    raise_if_invalid(cfg)
    OmegaConf.resolve(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg  # type: ignore[return-value]  # a DictConfig typed by RunConfig
