"""Validation of a composed run config against everything it names: the schema's rules, the model
family's declared architecture and capabilities, the plan-space rule, the cluster, the data keys,
and the freeze/param-group/LoRA globs against the family's real module FQNs (built on ``meta``).

Every problem is a :class:`~dhp.errors.ConfigIssue` (key path, value, rule, fix), all reported at once.
This layer sits above ``dhp.models`` and ``dhp.parallel`` (it asks them) and below the planner, which
validates each ``--auto`` candidate with the same :func:`validate`.
"""

from dhp.validation.load import load_config
from dhp.validation.validate import raise_if_invalid, validate

__all__ = ["load_config", "raise_if_invalid", "validate"]
