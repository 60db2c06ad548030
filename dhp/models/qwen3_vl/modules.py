"""Qwen3-VL cut into two modules: the vision encoder (merger + DeepStack mergers) and the LLM (with lm_head).

Both wrap transformers' own, unmodified classes; the vision module is the shared Qwen3 encoder wrapper
(``dhp/models/qwen3_vision/modules.py``) with K DeepStack levels. The cut is the one ``Qwen3VLModel.forward`` makes
internally: the encoder returns the merged image tokens (``pooler_output``) and one merged feature per
DeepStack level (``deepstack_features``), all with one row per image token in the same order. The LLM
scatters the image tokens into its input embeddings at the image-token positions and hands the
DeepStack features to transformers' text model, which adds feature k to the hidden states at those
positions after decoder layer k. Interleaved M-RoPE positions come from transformers'
``get_rope_index``. Neither module keeps state between calls (no ``rope_deltas``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel, Qwen3VLTextModel

from dhp.errors import DataError
from dhp.models.checks import check_image_alignment
from dhp.models.common import LossFn, loss_output, rope_index, scatter_rows, shifted_ce_sum
from dhp.models.family import LLMOutput
from dhp.models.qwen3_vision.arch import deepstack_kwarg
from dhp.models.qwen3_vision.modules import VisionModule

__all__ = ["LLMModule", "LossFn", "VisionModule", "deepstack_kwarg", "mrope_positions", "shifted_ce_sum"]


class LLMModule(nn.Module):
    """Token embeddings, decoder layers (DeepStack additions inside), final norm and lm_head -> summed loss.

    Placement: one actor group. Memory is dominated by model states, which is why ``dhp/parallel``
    shards this module by weights (TP/FSDP). ``config`` is the full Qwen3-VL config.
    """

    def __init__(self, language_model: Qwen3VLTextModel, lm_head: nn.Linear, config: Qwen3VLConfig) -> None:
        super().__init__()
        self.language_model = language_model
        self.lm_head = lm_head
        self.vl_config = config
        # a plain attribute, not a submodule: dhp.parallel swaps it for a vocab-parallel loss
        self.loss_fn: LossFn = shifted_ce_sum

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
        """One micro-batch -> ``LLMOutput(loss_sum, num_tokens)``.

        ``image_embeds`` and ``deepstack_embeds_k`` (the vision module's outputs) are placed at the
        image-token positions: the first in the input embeddings, feature k added after decoder layer k.
        Make them leaves with ``requires_grad`` to receive the gradients for the encoder's backward.
        Raises DataError when image tokens and embeddings disagree, when a DeepStack level is missing
        or extra, or when ``mm_token_type_ids`` is missing (M-RoPE would silently become 1D), and for
        videos (``second_per_grid_ts``): this family declares no video capability (``arch.CAPABILITIES``).
        """
        sample_ids = (
            sample_ids if sample_ids is not None else [f"batch[{i}]" for i in range(input_ids.shape[0])]
        )
        if second_per_grid_ts is not None:
            raise DataError(
                f"samples {sample_ids}: hold videos, but the qwen3_vl family has no video path proven "
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
        hidden = self.language_model(
            input_ids=None,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            visual_pos_masks=visual_pos_masks,
            deepstack_visual_embeds=deepstack,
            use_cache=False,
        ).last_hidden_state
        return self.loss(hidden=hidden, labels=labels)

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

    def loss(self, *, hidden: torch.Tensor, labels: torch.Tensor) -> LLMOutput:
        """``loss_fn(hidden, lm_head, labels)`` and the label-token count (``common.loss_output``)."""
        return loss_output(self.loss_fn, hidden=hidden, lm_head=self.lm_head, labels=labels)


def mrope_positions(
    *,
    config: Qwen3VLConfig,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
) -> torch.Tensor:
    """``(3, B, S)`` interleaved-M-RoPE positions computed by ``Qwen3VLModel.get_rope_index`` itself.

    A batch without images needs no ``mm_token_type_ids`` (all text: plain 1D positions in the 3 rows;
    ``common.rope_index``).
    """
    return rope_index(
        Qwen3VLModel,
        config.vision_config,
        input_ids=input_ids,
        attention_mask=attention_mask,
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=image_grid_thw,
    )
