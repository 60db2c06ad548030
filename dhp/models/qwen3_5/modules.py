"""Qwen3.5 cut into two modules: the vision encoder (merger, no DeepStack) and the hybrid LLM (with lm_head).

Both wrap transformers' own, unmodified classes; the vision module is the shared Qwen3 encoder wrapper
(``dhp/models/qwen3_vision/modules.py``) with K = 0 around ``Qwen3_5VisionModel``. The cut is the one
``Qwen3_5Model.forward`` makes internally: the encoder returns the merged image tokens
(``pooler_output``), one row per image token; the LLM scatters them into its input embeddings at the
image-token positions and runs ``Qwen3_5TextModel`` (Gated DeltaNet and gated full-attention layers by
``layer_types``; on CPU the DeltaNet layers run transformers' torch chunked gated-delta-rule fallback).
Interleaved, partial M-RoPE positions come from transformers' ``get_rope_index``. Neither module
keeps state between calls (no ``rope_deltas``, no cache).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3_5Config
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model, Qwen3_5TextModel

from dhp.errors import DataError
from dhp.models.checks import check_image_alignment
from dhp.models.common import LossFn, loss_output, rope_index, scatter_rows, shifted_ce_sum
from dhp.models.family import LLMOutput
from dhp.models.qwen3_vision.modules import VisionModule

__all__ = ["LLMModule", "LossFn", "VisionModule", "mrope_positions", "shifted_ce_sum"]


class LLMModule(nn.Module):
    """Token embeddings, the hybrid decoder layers, final norm and lm_head -> summed loss.

    Placement: one actor group. Memory is dominated by model states, which is why ``dhp/parallel``
    shards this module by weights (TP/FSDP); a DeltaNet layer keeps no KV cache, only its chunked
    recurrence's working set during the step. ``config`` is the full Qwen3.5 config.
    """

    def __init__(self, language_model: Qwen3_5TextModel, lm_head: nn.Linear, config: Qwen3_5Config) -> None:
        super().__init__()
        self.language_model = language_model
        self.lm_head = lm_head
        self.vl_config = config
        # a plain attribute, not a submodule: dhp.parallel swaps it for a vocab-parallel loss
        self.loss_fn: LossFn = shifted_ce_sum

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
        """One micro-batch -> ``LLMOutput(loss_sum, num_tokens)``.

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
        hidden = self.language_model(
            input_ids=None,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state
        return self.loss(hidden=hidden, labels=labels)

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
    config: Qwen3_5Config,
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
