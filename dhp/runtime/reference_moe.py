"""The router's load-balancing term of the single-process reference (``dhp verify``) for MoE models.

transformers' MoE ``...ForConditionalGeneration.forward`` adds ``router_aux_loss_coef *
load_balancing_loss_func(router_logits, num_experts, num_experts_per_tok, attention_mask)`` to its
mean LM loss, over the tokens of the batch it is called with. The plan computes it per micro-batch
over every data replica's tokens of that micro-batch (``dhp.parallel.ep.load_balancing_loss`` over the
module's token group) and weights it by that micro-batch's label tokens over the step's ``T``, so the
reference does the same: per micro-batch, the router logits of all its samples (each run alone)
concatenated, padding excluded by the attention masks, the same formula with no group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhp.parallel.ep import load_balancing_loss


@dataclass(frozen=True)
class RouterAux:
    """A model's load-balancing loss settings, read from transformers' MoE config fields."""

    coef: float
    experts: int
    top_k: int

    @classmethod
    def of(cls, hf_config) -> RouterAux | None:
        """From the text config's ``router_aux_loss_coef``/``num_experts``/``num_experts_per_tok``;
        None for a model without a router (a dense family)."""
        text = hf_config.get_text_config()
        names = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")
        if not all(hasattr(text, n) for n in names):
            return None
        return cls(float(text.router_aux_loss_coef), int(text.num_experts), int(text.num_experts_per_tok))

    def loss(self, logits: list[tuple[torch.Tensor, ...]], masks: list[torch.Tensor]) -> torch.Tensor:
        """The unweighted loss over one micro-batch: ``logits`` per sample, one [T_b, E] per MoE layer;
        ``masks`` per sample, its attention mask (any shape with T_b elements)."""
        layers = [torch.cat(per_layer, dim=0) for per_layer in zip(*logits, strict=True)]
        mask = torch.cat([m.reshape(-1) for m in masks]).to(layers[0].device)
        share, _ = load_balancing_loss(  # one process: the share is the whole loss, with its gradient
            layers, num_experts=self.experts, top_k=self.top_k, group=None, attention_mask=mask
        )
        return share
