"""The router's load-balancing loss of a mixture of experts, over any set of ranks and micro-batches.

The definition (transformers' ``load_balancing_loss_func``, the Switch Transformer's loss) over a set of
``R`` rows (unpadded tokens x MoE layers: every layer's router sees every token)::

    L = E * sum_e f_e * P_e,   f_e = C_e / R,   P_e = S_e / R

``C_e`` the top-k assignments to expert ``e`` and ``S_e`` the sum of its router probabilities, both over
the ``R`` rows. ``f`` has no gradient, so ``dL/dtheta = (E / R**2) * sum_e C_e * dS_e/dtheta``: the loss
is LINEAR in the probability sums once ``C`` and ``R`` are known. Everything here follows from that:

- the three sums (:class:`RouterStats`) are additive over tokens, so over ranks (an all-reduce) and over
  micro-batches (a plain sum);
- with ``C`` and ``R`` of a set of tokens known, each rank's micro-batch contributes the share
  ``E * sum_e (C_e / R) * s_e / R`` (``s`` its own probability sums, with their gradient): the shares over
  every rank and micro-batch of the set sum to ``L``, and their gradients, summed (as data parallelism
  sums gradients, and gradient accumulation adds them), are ``L``'s gradient (:func:`router_share`).

Which set of tokens ``L`` is taken over is the caller's definition. transformers computes it over the
batch of one call; dhp's training step computes it over the whole step's batch, like the LM loss
(``dhp.models.qwen3_base.llm.LLMModule.router_loss``): with one micro-batch per step the counts are
all-reduced inside the forward (:func:`load_balancing_loss`); with several, the runtime counts the step's
routing first (a forward without gradient) and every micro-batch's share uses those counts. Memory:
``[T_local, E]`` probabilities per MoE layer (transformers' recorded logits), ``2E + 1`` floats of sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dhp.errors import PlanError


@dataclass(frozen=True)
class RouterStats:
    """Sums over a set of rows (unpadded tokens x MoE layers) of a model's routers: ``counts`` [E] the
    top-k assignments per expert, ``probs`` [E] the router probabilities per expert (with their gradient
    when computed from live logits), ``rows`` [] the number of rows. Additive over tokens."""

    counts: torch.Tensor
    probs: torch.Tensor
    rows: torch.Tensor

    def loss(self, num_experts: int) -> torch.Tensor:
        """``L = E * sum_e (C_e / R) * (S_e / R)`` of these rows (transformers' value on them)."""
        return num_experts * torch.sum((self.counts / self.rows) * self.probs) / self.rows

    def values(self) -> torch.Tensor:
        """The sums as one detached 1-D float32 tensor ``[counts, probs, rows]`` (2E + 1 values)."""
        return torch.cat([self.counts, self.probs, self.rows.reshape(1)]).detach().float()

    @classmethod
    def of_values(cls, values: Sequence[float] | torch.Tensor, *, device: torch.device) -> RouterStats:
        """The inverse of :meth:`values` (constants on ``device``)."""
        v = torch.as_tensor(values, dtype=torch.float32, device=device)
        e = (v.numel() - 1) // 2
        return cls(counts=v[:e], probs=v[e : 2 * e], rows=v[2 * e])

    def all_reduced(self, group: dist.ProcessGroup | None) -> RouterStats:
        """These sums over every rank of ``group`` (detached; self when ``group`` has one rank or is None)."""
        if group is None or dist.get_world_size(group) == 1:
            return self
        v = self.values()
        dist.all_reduce(v, op=dist.ReduceOp.SUM, group=group)
        return RouterStats.of_values(v, device=v.device)


def router_stats(
    router_logits: Sequence[torch.Tensor],
    *,
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> RouterStats:
    """The :class:`RouterStats` of this rank's rows, as transformers accumulates them layer by layer.

    ``router_logits``: one [T_local, E] tensor per MoE layer (what transformers records with
    ``output_router_logits``); ``attention_mask``: any shape with ``T_local`` elements, 0 at padding
    (excluded; None: every row counts; a packed row's sample ids count as 1). ``probs`` keeps the logits' gradient; ``counts`` and ``rows``
    have none."""
    if not router_logits:
        raise PlanError(
            "load-balancing loss: no router logits (call the model with output_router_logits=True)."
        )
    dev = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=dev)
    probs_sum = torch.zeros(num_experts, dtype=torch.float32, device=dev)
    rows = torch.zeros((), dtype=torch.float32, device=dev)
    mask = None if attention_mask is None else (attention_mask.reshape(-1) != 0).to(dev, torch.float32)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        weight = (
            torch.ones_like(chosen, dtype=torch.float32) if mask is None else mask.repeat_interleave(top_k)
        )
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen, weight)
        probs_sum = probs_sum + (probs if mask is None else probs * mask.unsqueeze(-1)).sum(0)
        rows = rows + (probs.shape[0] if mask is None else mask.sum())
    return RouterStats(counts=counts.detach(), probs=probs_sum, rows=rows.detach())


def router_share(local: RouterStats, total: RouterStats, *, num_experts: int) -> torch.Tensor:
    """This rank's share of ``L`` over ``total``'s rows: ``E * sum_e (C_e / R) * s_e / R``, ``C`` and ``R``
    from ``total`` (constants), ``s`` = ``local.probs`` (with its gradient). The shares of every rank
    and micro-batch whose rows make up ``total`` sum to ``total.loss(E)``, their gradients to its."""
    return num_experts * torch.sum((total.counts / total.rows) * local.probs) / total.rows


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    *,
    num_experts: int,
    top_k: int,
    group: dist.ProcessGroup | None,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's share, the value) of ``load_balancing_loss_func`` over ``group``'s tokens of this call.

    ``group``: the ranks whose tokens form the batch (dp x fsdp x cp x sp, never TP duplicates; None =
    this rank alone). The counts and rows are all-reduced over ``group``, so the shares of its ranks
    sum to transformers' value on their concatenated tokens (the second element, all-reduced, detached)
    and their gradients, summed over the ranks, are its gradient (:func:`router_share`).
    """
    local = router_stats(router_logits, num_experts=num_experts, top_k=top_k, attention_mask=attention_mask)
    total = local.all_reduced(group)
    share = router_share(local, total, num_experts=num_experts)
    value = share.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return share, value
