"""Qwen3-VL-MoE's LLM module: transformers' ``Qwen3VLMoeTextModel`` + ``lm_head``, DeepStack edges, and
the LM loss plus the router's load-balancing loss.

The cut is the one ``Qwen3VLMoeModel.forward`` makes internally (as Qwen3-VL's): the encoder returns
the merged image tokens and one merged feature per DeepStack level, one row per image token; this
module scatters the image tokens into its input embeddings and hands the DeepStack features to the
text model, which adds feature k at the image-token positions after decoder layer k. Interleaved
M-RoPE positions come from transformers' ``get_rope_index``. No state between calls.

The auxiliary loss is the one ``Qwen3VLMoeForConditionalGeneration.forward`` adds: transformers'
``load_balancing_loss_func`` over every router's logits (recorded by transformers' own
``output_router_logits``), with the 2-D padding ``attention_mask`` excluding pad tokens, times
``router_aux_loss_coef``, added to the mean LM loss. Here it is computed by
:func:`dhp.parallel.ep.load_balancing_loss` (the same formula; over ``aux_loss_group``'s tokens when
the batch is spread over ranks) and put into ``loss_sum`` in token-sum units (see
:meth:`LLMModule.router_loss`), so ``loss_sum / num_tokens`` is transformers' ``loss`` exactly; its
unweighted value is returned beside (``LLMOutput.aux_losses["router_aux_loss"]``, transformers'
``aux_loss``) for logging.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from transformers import Qwen3VLMoeConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeModel, Qwen3VLMoeTextModel

from dhp.errors import DataError
from dhp.models.checks import check_image_alignment
from dhp.models.common import LossFn, loss_output, rope_index, scatter_rows, shifted_ce_sum
from dhp.models.family import LLMOutput
from dhp.models.qwen3_vision.arch import deepstack_kwarg
from dhp.parallel.ep import load_balancing_loss

__all__ = ["ROUTER_AUX_LOSS", "LLMModule", "deepstack_kwarg", "mrope_positions"]

IMAGE_EMBEDS = "image_embeds"
#: the name of the (unweighted) load-balancing loss in ``LLMOutput.aux_losses`` and the metrics
ROUTER_AUX_LOSS = "router_aux_loss"


class LLMModule(nn.Module):
    """Token embeddings, decoder layers (attention; sparse-MoE or dense MLPs; DeepStack additions),
    final norm and lm_head -> LM loss sum + the weighted load-balancing loss.

    Placement: one actor group. Memory is dominated by the experts (``3*E*I*H`` per sparse layer),
    which is why ``dhp/parallel`` shards them by expert (EP, ``parallel_plan().moe_blocks``) and the
    attention by weights (TP). ``config`` is the full Qwen3-VL-MoE config.

    ``aux_loss_group``: the process group whose ranks hold DIFFERENT tokens of the step's batch (the
    module's dp x fsdp x sp ranks, never TP duplicates), set by whoever parallelizes the module; then
    the load-balancing loss is the global batch's (its per-expert counts are all-reduced). None (the
    default): this rank's tokens alone, which under DP makes the step's aux term a token-weighted
    mean of per-rank losses instead of transformers' value on the concatenated batch. A plain
    attribute, like ``loss_fn``.
    """

    def __init__(
        self, language_model: Qwen3VLMoeTextModel, lm_head: nn.Linear, config: Qwen3VLMoeConfig
    ) -> None:
        super().__init__()
        self.language_model = language_model
        self.lm_head = lm_head
        self.vl_config = config
        # plain attributes, not submodules: dhp.parallel swaps them (vocab-parallel loss, token group)
        self.loss_fn: LossFn = shifted_ce_sum
        self.aux_loss_group: dist.ProcessGroup | None = None

    @property
    def num_deepstack(self) -> int:
        """K, the number of DeepStack features this LLM expects with the image embeddings."""
        return len(self.vl_config.vision_config.deepstack_visual_indexes)

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
        **deepstack_embeds: torch.Tensor,
    ) -> LLMOutput:
        """One micro-batch -> ``LLMOutput(loss_sum, num_tokens, aux_losses)``.

        ``loss_sum`` = the LM cross-entropy sum + the weighted load-balancing term (:meth:`router_loss`).
        ``image_embeds`` and ``deepstack_embeds_k`` (the vision module's outputs) are placed at the
        image-token positions: the first in the input embeddings, feature k added after decoder layer k.
        Raises DataError when image tokens and embeddings disagree, when a DeepStack level is missing
        or extra, when ``mm_token_type_ids`` is missing, and for videos (no video capability).
        """
        sample_ids = (
            sample_ids if sample_ids is not None else [f"batch[{i}]" for i in range(input_ids.shape[0])]
        )
        if second_per_grid_ts is not None:
            raise DataError(
                f"samples {sample_ids}: hold videos, but the qwen3_vl_moe family has no video path proven "
                f"against transformers (it declares video=False). Fix: drop the video records from the "
                f"dataset, or train them with a family that declares video (qwen2_5_vl)."
            )
        deepstack = self._deepstack_list(image_embeds, deepstack_embeds, sample_ids)
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
        visual_pos_masks = None
        if deepstack is not None:
            visual_pos_masks = (input_ids == self.vl_config.image_token_id).to(inputs_embeds.device)
        out = self.language_model(
            input_ids=None,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            visual_pos_masks=visual_pos_masks,
            deepstack_visual_embeds=deepstack,
            use_cache=False,
            output_router_logits=True,  # transformers' recorder: every router's [B*S, E] logits
        )
        lm = loss_output(self.loss_fn, hidden=out.last_hidden_state, lm_head=self.lm_head, labels=labels)
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

        ``load_balancing_loss`` gives this rank's share ``s_r`` of the loss ``L`` over the group's tokens
        (shares sum to ``L``). The term is ``coef * s_r * N``, ``N`` the group's label tokens of this
        micro-batch (all-reduced), so that with the runtime's ``sum_r loss_sum_r / N`` the step's loss
        is ``mean CE + coef * L``: transformers' ``loss`` for one rank and one micro-batch, and for
        several micro-batches their token-weighted mean, as the LM loss. Gradients flow through the
        router probabilities only (the expert counts are constants, as in transformers).
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

    def _deepstack_list(
        self,
        image_embeds: torch.Tensor | None,
        deepstack_embeds: dict[str, torch.Tensor],
        sample_ids: list[str],
    ) -> list[torch.Tensor] | None:
        """``deepstack_embeds_0..K-1`` in level order; None without images. DataError on a mismatch."""
        expected = [deepstack_kwarg(k) for k in range(self.num_deepstack)]
        if image_embeds is None:
            if deepstack_embeds:
                raise DataError(
                    f"samples {sample_ids}: DeepStack features {sorted(deepstack_embeds)} were given without "
                    f"image_embeds. Fix: pass all of the vision module's outputs together, or none."
                )
            return None
        if sorted(deepstack_embeds) != sorted(expected):
            raise DataError(
                f"samples {sample_ids}: the LLM expects DeepStack features {expected} with image_embeds "
                f"(vision_config.deepstack_visual_indexes has {self.num_deepstack} levels) but got "
                f"{sorted(deepstack_embeds)}. Fix: pass every output of the vision module as a keyword."
            )
        out = []
        for name in expected:
            feature = deepstack_embeds[name]
            if feature.shape != image_embeds.shape:
                raise DataError(
                    f"samples {sample_ids}: {name} has shape {tuple(feature.shape)} but image_embeds has "
                    f"{tuple(image_embeds.shape)}; each DeepStack level has one row per image token. Fix: "
                    f"send the same rows of every vision output."
                )
            out.append(feature)
        return out

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


def mrope_positions(
    *,
    config: Qwen3VLMoeConfig,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
) -> torch.Tensor:
    """``(3, B, S)`` interleaved-M-RoPE positions computed by ``Qwen3VLMoeModel.get_rope_index`` itself."""
    return rope_index(
        Qwen3VLMoeModel,
        config.vision_config,
        input_ids=input_ids,
        attention_mask=attention_mask,
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=image_grid_thw,
    )
