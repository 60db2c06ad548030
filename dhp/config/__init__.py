"""Typed run config: schema, Hydra composition, validation, smoke-run shrinking."""

from dhp.config.loader import compose_config, list_recipes, load_config
from dhp.config.schema import RunConfig
from dhp.config.validate import raise_if_invalid, validate

__all__ = ["RunConfig", "compose_config", "list_recipes", "load_config", "raise_if_invalid", "validate"]
