"""A model's numbers are written once, in ``conf/model/<name>.yaml``; code that needs them as a
:class:`~dhp.config.schema.ModelConfig` (a family's tiny test model) reads that file."""

from __future__ import annotations

from omegaconf import OmegaConf

from dhp.config.loader import CONF_DIR
from dhp.config.schema import ModelConfig


def model_entry(name: str) -> ModelConfig:
    """``conf/model/<name>.yaml`` over the schema's defaults, as a ModelConfig dataclass."""
    merged = OmegaConf.merge(
        OmegaConf.structured(ModelConfig), OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")
    )
    return OmegaConf.to_object(merged)
