"""Qwen2.5-VL cut into two modules: the vision encoder (with merger) and the LLM (with lm_head).

Both wrap transformers' own, unmodified classes. The cut is the one ``Qwen2_5_VLModel.forward``
makes internally: the encoder's ``pooler_output`` (original token order) is scattered into the
LLM's input embeddings at the image-token positions; M-RoPE positions come from transformers'
``get_rope_index``. Neither module keeps state between calls (no ``rope_deltas``).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLTextConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel, Qwen2_5_VLTextModel

from dhp.models.common import LLMBase, LossFn, TextCall, rope_index, sample_names, shifted_ce_sum
from dhp.models.family import LLMOutput
from dhp.models.qwen2_5_vision.modules import VisionModule
from dhp.models.qwen2_5_vl.video import split_visual

__all__ = ["LLMModule", "LossFn", "VisionModule", "mrope_positions", "shifted_ce_sum"]


class LLMModule(LLMBase):
    """Token embeddings, decoder layers, final norm and lm_head, returning the summed token loss.

    Placement: one actor group. Memory is dominated by model states, which is why ``dhp/parallel``
    shards this module by weights (TP/FSDP). ``config`` is the full Qwen2.5-VL config (images
    allowed) or a ``Qwen2_5_VLTextConfig`` (a text-only model: any image is an error).
    """

    def __init__(
        self,
        language_model: Qwen2_5_VLTextModel,
        lm_head: nn.Linear,
        config: Qwen2_5_VLConfig | Qwen2_5_VLTextConfig,
    ) -> None:
        super().__init__(language_model, lm_head, config if isinstance(config, Qwen2_5_VLConfig) else None)

    @property
    def accepts_images(self) -> bool:
        """False for a text-only config."""
        return self.vl_config is not None

    def prepare(
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
        hidden_states: torch.Tensor | None = None,
    ) -> TextCall:
        """One micro-batch's text-model call (``forward`` = prepare, the text model, :meth:`finish`).

        ``image_embeds`` (the vision module's output for all images of the micro-batch, in order)
        is placed at the image-token positions. Make it a leaf with ``requires_grad`` to receive the
        gradient for the encoder's backward. Raises DataError when image tokens and embeddings
        disagree, or when ``mm_token_type_ids`` is missing (M-RoPE would silently become 1D).
        ``hidden_states`` (a later pipeline stage): the previous stage's output replaces the input
        embeddings (no lookup, no image rows placed); the positions and masks are the micro-batch's.
        """
        sample_ids = sample_names(input_ids, sample_ids)
        inputs_embeds = hidden_states
        if hidden_states is None:
            inputs_embeds = self.embed(
                input_ids=input_ids,
                mm_token_type_ids=mm_token_type_ids,
                image_grid_thw=image_grid_thw,
                image_embeds=image_embeds,
                sample_ids=sample_ids,
            )
        # images and videos share one ordered item stream; M-RoPE takes them apart (video.py)
        image_grid_thw, video_grid_thw, second_per_grid_ts = split_visual(
            mm_token_type_ids=mm_token_type_ids, grids=image_grid_thw, second_per_grid_ts=second_per_grid_ts
        )
        video = {"video_grid_thw": video_grid_thw, "second_per_grid_ts": second_per_grid_ts}
        position_ids, text_mask, extra = self.text_inputs(
            inputs_embeds=inputs_embeds,
            input_ids=input_ids,
            attention_mask=attention_mask,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=image_grid_thw,
            **video,
        )
        kwargs = dict(attention_mask=text_mask, position_ids=position_ids, use_cache=False, **extra)
        return TextCall(inputs_embeds=inputs_embeds, kwargs=kwargs, labels=labels, state={})

    def finish(self, out: Any, call: TextCall) -> LLMOutput:
        """The summed token loss of the text model's last hidden state."""
        return self.loss(hidden=out.last_hidden_state, labels=call.labels)

    def placed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Images and videos are one ordered stream of visual items: both take the encoder's rows."""
        return (input_ids == self.vl_config.image_token_id) | (input_ids == self.vl_config.video_token_id)

    def positions(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        mm_token_type_ids: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """M-RoPE positions ``(3, B, S)`` from transformers' own ``get_rope_index`` (no model state)."""
        if mm_token_type_ids is None:  # text-only config: no image can be present (checked in embed)
            mm_token_type_ids = torch.zeros_like(input_ids)
        return mrope_positions(
            config=self.vl_config,
            input_ids=input_ids,
            attention_mask=attention_mask,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts,
        )


def mrope_positions(
    *,
    config: Qwen2_5_VLConfig | None,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(3, B, S)`` M-RoPE positions computed by ``Qwen2_5_VLModel.get_rope_index`` itself.

    A text-only config (None) has no vision tower: a stand-in vision config with merge 1 (``common.rope_index``).
    """
    vision = (
        config.vision_config
        if config is not None
        else types.SimpleNamespace(spatial_merge_size=1, tokens_per_second=1)
    )
    return rope_index(
        Qwen2_5_VLModel,
        vision,
        input_ids=input_ids,
        attention_mask=attention_mask,
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        second_per_grid_ts=second_per_grid_ts,
    )
