"""The module graph as the runtime walks it: a family's edges grouped into links, one payload each.

A :class:`Link` is every :class:`~dhp.models.family.HandOff` of one (producer, consumer, layout): the
producer's output tensors for those edges are concatenated on the last dim (edge order) and moved as
one payload per destination; the consumer splits them back by width. Gradients come back the same
way, for the edges with ``grad`` only. Nothing here names a model family or an edge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhp.errors import PlanError
from dhp.models.family import LAYOUTS, HandOff


@dataclass(frozen=True)
class Link:
    """The edges of one (producer, consumer, layout), moved together."""

    producer: str
    consumer: str
    layout: str
    edges: tuple[HandOff, ...]

    @property
    def width(self) -> int:
        """Columns of one payload row (all edges)."""
        return sum(e.width for e in self.edges)

    @property
    def grad_edges(self) -> tuple[HandOff, ...]:
        return tuple(e for e in self.edges if e.grad)

    @property
    def grad_width(self) -> int:
        """Columns of one gradient row (edges with ``grad``)."""
        return sum(e.width for e in self.grad_edges)

    def pack(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The producer's ``{kwarg: (rows, width)}`` -> ``(rows, self.width)`` in edge order."""
        parts = [outputs[e.kwarg] for e in self.edges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def split(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """``(rows, self.width)`` -> ``{kwarg: (rows, width)}`` (views: their grads flow into ``rows``);
        edges without ``grad`` are detached."""
        parts = rows.split([e.width for e in self.edges], dim=-1)
        return {e.kwarg: p if e.grad else p.detach() for e, p in zip(self.edges, parts, strict=True)}

    def grad_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The gradient payload from the consumer's ``(rows, self.width)`` leaf gradient: its grad edges' columns."""
        if len(self.grad_edges) == len(self.edges):
            return rows
        cols, start = [], 0
        for e in self.edges:
            if e.grad:
                cols.append(rows[:, start : start + e.width])
            start += e.width
        return torch.cat(cols, dim=-1)

    def backward_pairs(
        self, outputs: dict[str, torch.Tensor], grad: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(tensors, grads)`` for ``torch.autograd.backward`` from a gradient payload."""
        parts = grad.split([e.width for e in self.grad_edges], dim=-1)
        return [outputs[e.kwarg] for e in self.grad_edges], list(parts)


def links_of(handoffs: tuple[HandOff, ...]) -> tuple[Link, ...]:
    """Group edges by (producer, consumer, layout), in first-seen order; PlanError for an unknown layout."""
    order: dict[tuple[str, str, str], list[HandOff]] = {}
    for e in handoffs:
        if e.layout not in LAYOUTS:
            raise PlanError(
                f"hand-off {e.producer} -> {e.consumer} ({e.kwarg}) has layout {e.layout!r}; the runtime "
                f"routes {tuple(LAYOUTS)}. Fix: declare the edge with a known layout in the family."
            )
        order.setdefault((e.producer, e.consumer, e.layout), []).append(e)
    return tuple(Link(p, c, lay, tuple(es)) for (p, c, lay), es in order.items())
