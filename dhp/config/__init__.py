"""Typed run config: the schema, Hydra composition, smoke-run shrinking, the pure rules (the plan-space
rule, data keys, guards) and ``ConfigIssue`` collection. Validating against a model family and freezing
a config is ``dhp.validation`` (``load_config``, ``validate``), one layer above the families."""

from dhp.config.loader import compose_config, compose_run, list_recipes
from dhp.config.schema import RunConfig

__all__ = ["RunConfig", "compose_config", "compose_run", "list_recipes"]
