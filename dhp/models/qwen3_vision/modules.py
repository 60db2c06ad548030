"""The Qwen3 vision encoder as a dhp module: transformers' own vision model, whatever family names it.

Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 ship the same encoder under three class names; the family builds its
transformers class and wraps it here. The wrapper returns the merged image tokens (``pooler_output``)
and, for ``K > 0`` DeepStack levels, one merged feature per level (``deepstack_features``), all with one
row per image token in the same order. ``K = 0`` (Qwen3.5) returns ``image_embeds`` alone.
"""

from __future__ import annotations

import torch
from torch import nn

from dhp.models.checks import check_vision_inputs
from dhp.models.qwen3_vision.arch import IMAGE_EMBEDS, deepstack_kwarg

__all__ = ["VisionModule"]


class VisionModule(nn.Module):
    """The vision encoder incl. the patch merger and the ``K`` DeepStack mergers.

    Placement: one actor group. Memory is dominated by activations (patches x hidden per block), which
    is why ``dhp/parallel`` shards this module by sequence (Ulysses), not by weights. Its output is
    ``1 + K`` tensors of ``(N_image_tokens, llm_hidden)``, all sent to the LLM.
    """

    def __init__(self, visual: nn.Module, *, num_deepstack: int) -> None:
        super().__init__()
        self.visual = visual
        self._num_deepstack = num_deepstack

    @property
    def num_deepstack(self) -> int:
        """K, the number of DeepStack levels (encoder layers whose features reach the LLM); 0 = none."""
        return self._num_deepstack

    def forward(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, **vision_kwargs
    ) -> dict[str, torch.Tensor]:
        """``(N_patches, C*T*P*P)`` patches of all images in order -> ``{kwarg: (N_image_tokens, llm_hidden)}``.

        Keys: ``image_embeds`` and ``deepstack_embeds_0 .. deepstack_embeds_{K-1}``; rows in the original
        token order, image after image, the same rows in every tensor. ``vision_kwargs`` pass through to
        the transformers forward (precomputed ``interp_indices``/``interp_weights``/``position_ids``/
        ``cu_seqlens`` for a sequence-parallel shard, ``sp.py``); without them the rows must be the whole
        batch.
        """
        check_vision_inputs(  # an SP shard holds its own rows of the whole grid: width and grid still checked
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            config=self.visual.config,
            shard_rows=int(pixel_values.shape[0]) if "interp_indices" in vision_kwargs else None,
        )
        pixel_values = pixel_values.to(self.visual.patch_embed.proj.weight.dtype)
        out = self.visual(pixel_values, grid_thw=image_grid_thw, **vision_kwargs)
        embeds = {IMAGE_EMBEDS: out.pooler_output}
        if self._num_deepstack == 0:
            return embeds
        for level, feature in enumerate(out.deepstack_features):
            embeds[deepstack_kwarg(level)] = feature
        return embeds
