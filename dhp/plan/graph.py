"""The module graph the planner plans: which module computes the loss and which modules feed it.

Read off the family's typed architecture (:class:`dhp.models.arch.Architecture`), never off module
names: the CONSUMER is the one module that computes the loss over a vocab-parallel head
(``ModuleArch.vocab > 0``); the PRODUCERS are the modules that emit a hand-off edge the consumer
takes (``ModuleArch.outputs`` meeting the consumer's ``inputs``), in declaration order. A run plans
the producers its config's ``modules`` mapping holds (:meth:`ModuleGraph.within`).

One step runs, per micro-batch, every producer's forward, the hand-off, the consumer's forward and
backward, the hand-back and the producers' backwards (last declared first), then the step's grad
sync, grad norm and optimizer: :meth:`ModuleGraph.phases`, the memory timeline's phases.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from omegaconf import DictConfig

from dhp.errors import PlanError
from dhp.models.arch import Architecture, ModuleArch
from dhp.plan.params import architecture

#: the phases after every micro-batch of a step
FINISH_PHASES = ("grad_sync", "grad_norm", "optimizer")


def computes_loss(module: ModuleArch) -> bool:
    """Whether ``module`` computes the loss (a vocab-parallel head: the graph's consumer)."""
    return module.vocab > 0


@dataclass(frozen=True)
class ModuleGraph:
    """The consumer (the loss module) and the producers feeding it, in declaration order."""

    consumer: str
    producers: tuple[str, ...] = ()

    @property
    def modules(self) -> tuple[str, ...]:
        """Producers, then the consumer."""
        return (*self.producers, self.consumer)

    def within(self, names: Iterable[str]) -> ModuleGraph:
        """The graph restricted to the producers among ``names`` (a run's modules)."""
        keep = {str(n) for n in names}
        return ModuleGraph(self.consumer, tuple(p for p in self.producers if p in keep))

    def phases(self) -> tuple[str, ...]:
        """A step's phases in the driver's order (module docstring)."""
        return (
            *(f"{p}_fwd" for p in self.producers),
            "handoff",
            f"{self.consumer}_fwd",
            f"{self.consumer}_bwd",
            "handback",
            *(f"{p}_bwd" for p in reversed(self.producers)),
            *FINISH_PHASES,
        )


def module_graph(arch: Architecture) -> ModuleGraph:
    """The graph of ``arch``: exactly one loss module; the modules with an edge into it feed it.
    Raises PlanError when no module, or more than one, computes the loss."""
    losses = [str(n) for n, m in arch.modules.items() if computes_loss(m)]
    if len(losses) != 1:
        raise PlanError(
            f"the model's modules {sorted(arch.modules)} have {len(losses)} loss modules "
            f"({losses}); the planner needs exactly one. Fix: declare vocab > 0 on one module only."
        )
    consumer = losses[0]
    takes = set(arch.modules[consumer].inputs)
    producers = tuple(
        str(n) for n, m in arch.modules.items() if str(n) != consumer and takes.intersection(m.outputs)
    )
    return ModuleGraph(consumer, producers)


def run_graph(config: DictConfig) -> ModuleGraph:
    """The graph of a run: its model's, with the producers its ``modules`` mapping holds."""
    return module_graph(architecture(config.model)).within(config.modules)
