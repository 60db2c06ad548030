"""Qwen3.5 cut into two modules: the vision encoder (merger, no DeepStack) and the hybrid LLM (with lm_head).

Both wrap transformers' own, unmodified classes; the vision module is the shared Qwen3 encoder wrapper
(``dhp/models/qwen3_vision/modules.py``) with K = 0 around ``Qwen3_5VisionModel``. The cut is the one
``Qwen3_5Model.forward`` makes internally: the encoder returns the merged image tokens
(``pooler_output``), one row per image token; the LLM scatters them into its input embeddings at the
image-token positions and runs ``Qwen3_5TextModel`` (Gated DeltaNet and gated full-attention layers by
``layer_types``; on CPU the DeltaNet layers run transformers' torch chunked gated-delta-rule fallback).
Interleaved, partial M-RoPE positions come from transformers' ``get_rope_index``. Neither module
keeps state between calls (no ``rope_deltas``, no cache).

MoE flavour (``Qwen3_5MoeTextModel``): the LLM also adds the router's load-balancing loss exactly as
``Qwen3_5MoeForConditionalGeneration`` does (``router_aux_loss_coef *`` transformers'
``load_balancing_loss_func`` over every layer's router logits, padding excluded by the attention mask,
added to the mean LM loss); its unweighted value is returned beside
(``LLMOutput.aux_losses["router_aux_loss"]``) for logging.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from transformers import Qwen3_5Config, Qwen3_5MoeConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model, Qwen3_5TextModel
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextModel

from dhp.errors import DataError
from dhp.models.checks import check_image_alignment
from dhp.models.common import LossFn, loss_output, rope_index, scatter_rows, shifted_ce_sum
from dhp.models.family import LLMOutput
from dhp.models.qwen3_vision.modules import VisionModule
from dhp.parallel.ep import load_balancing_loss

__all__ = ["ROUTER_AUX_LOSS", "LLMModule", "LossFn", "VisionModule", "mrope_positions", "shifted_ce_sum"]

#: the name of the (unweighted) load-balancing loss in ``LLMOutput.aux_losses`` and the metrics
ROUTER_AUX_LOSS = "router_aux_loss"


class LLMModule(nn.Module):
    """Token embeddings, the hybrid decoder layers, final norm and lm_head -> summed loss.

    Placement: one actor group. Memory is dominated by model states, which is why ``dhp/parallel``
    shards this module by weights (TP/FSDP); a DeltaNet layer keeps no KV cache, only its chunked
    recurrence's working set during the step. ``config`` is the full Qwen3.5 config.

    MoE flavour (a ``Qwen3_5MoeConfig``): memory is dominated by the routed experts (``3*E*I*H`` per
    layer), which ``dhp/parallel`` shards by expert (EP, ``parallel_plan().moe_blocks``).
    ``aux_loss_group``: the process group whose ranks hold DIFFERENT tokens of the step's batch (the
    module's dp x fsdp ranks, never TP duplicates), set by ``dhp.parallel``; then the load-balancing
    loss is the global batch's (per-expert counts all-reduced). None: this rank's tokens alone. A plain
    attribute, like ``loss_fn``; unused by the dense flavour.
    """

    def __init__(
        self,
        language_model: Qwen3_5TextModel | Qwen3_5MoeTextModel,
        lm_head: nn.Linear,
        config: Qwen3_5Config | Qwen3_5MoeConfig,
    ) -> None:
        super().__init__()
        self.language_model = language_model
        self.lm_head = lm_head
        self.vl_config = config
        self.moe = isinstance(config, Qwen3_5MoeConfig)
        # plain attributes, not submodules: dhp.parallel swaps them (vocab-parallel loss, token group)
        self.loss_fn: LossFn = shifted_ce_sum
        self.aux_loss_group: dist.ProcessGroup | None = None

    def forward(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        mm_token_type_ids: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        sample_ids: list[str] | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
    ) -> LLMOutput:
        """One micro-batch -> ``LLMOutput(loss_sum, num_tokens)`` (MoE flavour: ``loss_sum`` includes
        the weighted load-balancing term, :meth:`router_loss`, and ``aux_losses`` its unweighted value).

        ``image_embeds`` (the vision module's output) is placed at the image-token positions of the
        input embeddings; make it a leaf with ``requires_grad`` to receive the gradient for the
        encoder's backward. Raises DataError when image tokens and embeddings disagree, when
        ``mm_token_type_ids`` is missing with images (M-RoPE would silently become 1D), and for videos
        (``second_per_grid_ts``): this family declares no video capability (``arch.CAPABILITIES``).
        """
        sample_ids = (
            sample_ids if sample_ids is not None else [f"batch[{i}]" for i in range(input_ids.shape[0])]
        )
        if second_per_grid_ts is not None:
            raise DataError(
                f"samples {sample_ids}: hold videos, but the qwen3_5 family has no video path proven "
                f"against transformers (it declares video=False). Fix: drop the video records from the "
                f"dataset, or train them with a family that declares video (qwen2_5_vl)."
            )
        inputs_embeds = self.embed(
            input_ids=input_ids,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=image_grid_thw,
            image_embeds=image_embeds,
            sample_ids=sample_ids,
        )
        position_ids = mrope_positions(
            config=self.vl_config,
            input_ids=input_ids,
            attention_mask=attention_mask,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=image_grid_thw,
        )
        router = {"output_router_logits": True} if self.moe else {}  # transformers' recorder, [B*S, E]
        out = self.language_model(
            input_ids=None,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **router,
        )
        lm = self.loss(hidden=out.last_hidden_state, labels=labels)
        if not self.moe:
            return lm
        term, aux = self.router_loss(
            out.router_logits, attention_mask=attention_mask, num_tokens=lm.num_tokens
        )
        return LLMOutput(
            loss_sum=lm.loss_sum + term, num_tokens=lm.num_tokens, aux_losses={ROUTER_AUX_LOSS: aux}
        )

    def router_loss(
        self, router_logits: tuple[torch.Tensor, ...], *, attention_mask: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the weighted load-balancing term in ``loss_sum`` units, the unweighted global loss, detached).

        ``load_balancing_loss`` gives this rank's share ``s_r`` of the loss ``L`` over the group's tokens;
        the term is ``coef * s_r * N`` (``N`` the group's label tokens of this micro-batch), so that the
        runtime's ``sum_r loss_sum_r / N`` is ``mean CE + coef * L``: transformers' ``loss`` for one rank
        and one micro-batch. Gradients flow through the router probabilities only (the expert counts are
        constants, as in transformers).
        """
        t = self.vl_config.text_config
        share, total = load_balancing_loss(
            router_logits,
            num_experts=t.num_experts,
            top_k=t.num_experts_per_tok,
            group=self.aux_loss_group,
            attention_mask=attention_mask,
        )
        tokens = torch.tensor(float(num_tokens), device=share.device)
        if self.aux_loss_group is not None and dist.get_world_size(self.aux_loss_group) > 1:
            dist.all_reduce(tokens, op=dist.ReduceOp.SUM, group=self.aux_loss_group)
        return t.router_aux_loss_coef * share * tokens, total

    def embed(
        self,
        *,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        image_embeds: torch.Tensor | None,
        sample_ids: list[str],
    ) -> torch.Tensor:
        """Token embeddings ``(B, S, H)`` with the image embeddings scattered at image-token positions."""
        check_image_alignment(
            input_ids=input_ids,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=image_grid_thw,
            image_embeds=image_embeds,
            config=self.vl_config,
            sample_ids=sample_ids,
        )
        inputs_embeds = self.language_model.embed_tokens(input_ids)
        if image_embeds is None:
            return inputs_embeds
        return scatter_rows(inputs_embeds, input_ids == self.vl_config.image_token_id, image_embeds)

    def loss(self, *, hidden: torch.Tensor, labels: torch.Tensor) -> LLMOutput:
        """``loss_fn(hidden, lm_head, labels)`` and the label-token count (``common.loss_output``)."""
        return loss_output(self.loss_fn, hidden=hidden, lm_head=self.lm_head, labels=labels)


def mrope_positions(
    *,
    config: Qwen3_5Config | Qwen3_5MoeConfig,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
) -> torch.Tensor:
    """``(3, B, S)`` M-RoPE positions computed by ``Qwen3_5Model.get_rope_index`` itself.

    A batch without images needs no ``mm_token_type_ids`` (all text: plain 1D positions in the 3 rows;
    ``common.rope_index``).
    """
    return rope_index(
        Qwen3_5Model,
        config.vision_config,
        input_ids=input_ids,
        attention_mask=attention_mask,
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=image_grid_thw,
    )
