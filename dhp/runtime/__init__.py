"""Ray runtime: actor groups, worker contracts, the cross-group hand-off and the driver step."""

from dhp.runtime.driver import StepResult, Trainer

__all__ = ["StepResult", "Trainer"]
