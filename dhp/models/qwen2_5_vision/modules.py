"""The Qwen2.5-VL-style vision encoder as a module: pixel patches -> LLM-width image embeddings.

Shared by the families whose encoder is Qwen2.5-VL's window-attention ViT with a 2x2 merger
(Qwen2.5-VL: ``Qwen2_5_VisionTransformerPretrainedModel``; Qwen2.5-Omni: ``Qwen2_5OmniVisionEncoder``,
the same forward with separate q/k/v projections). It wraps transformers' own, unmodified encoder.
"""

from __future__ import annotations

import torch
from torch import nn

from dhp.models.checks import check_vision_inputs

__all__ = ["VisionModule"]


class VisionModule(nn.Module):
    """The vision encoder incl. the patch merger: pixel patches -> LLM-width image embeddings.

    Placement: one actor group. Memory is dominated by activations (patches x hidden per block),
    which is why ``dhp/parallel`` shards this module by sequence (Ulysses), not by weights.
    """

    def __init__(self, visual: nn.Module) -> None:
        super().__init__()
        self.visual = visual

    @property
    def tokens_per_image_divisor(self) -> int:
        """Patches per output token (spatial_merge_size ** 2)."""
        return self.visual.spatial_merge_unit

    def forward(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, **vision_kwargs
    ) -> dict[str, torch.Tensor]:
        """``(N_patches, C*T*P*P)`` patches -> ``{"image_embeds": (N_image_tokens, llm_hidden)}``.

        Whole batch: rows come back in the original token order (``pooler_output``), image after image,
        ready to be scattered at the image-token positions. An SP shard (``VisionShard.forward_kwargs()``:
        precomputed ``window_index``/``cu_window_seqlens``/``cu_seqlens``, pixel rows of its windows only)
        gives the rows of its ``token_index``. A shard without rows (fewer windows than SP ranks) runs
        the full-attention blocks on zero rows, so the attention collectives that ``dhp.parallel``
        installs there still meet every rank, and returns ``(0, llm_hidden)``.
        """
        windows = vision_kwargs.get("cu_window_seqlens")  # forward kwargs, not config: absent = whole batch
        check_vision_inputs(
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            config=self.visual.config,
            shard_rows=None if windows is None else int(windows[-1]) if len(windows) else 0,
        )
        pixel_values = pixel_values.to(self.visual.patch_embed.proj.weight.dtype)
        if pixel_values.shape[0] == 0 and windows is not None:
            return {"image_embeds": self._no_rows(pixel_values, **vision_kwargs)}
        out = self.visual(pixel_values, grid_thw=image_grid_thw, **vision_kwargs).pooler_output
        return {"image_embeds": out}

    def _no_rows(self, pixel_values: torch.Tensor, **vision_kwargs) -> torch.Tensor:
        """Zero patch rows: the full-attention blocks on zero rows (window blocks have nothing to do),
        then the merger: ``(0, llm_hidden)``, still connected to the parameters for backward."""
        visual = self.visual
        hidden = visual.patch_embed(pixel_values)
        empty = hidden.new_zeros(0, visual.config.hidden_size // visual.config.num_heads)
        passed = {k: v for k, v in vision_kwargs.items() if k not in _PRECOMPUTED}
        for index in sorted(visual.fullatt_block_indexes):
            hidden = visual.blocks[index](
                hidden,
                cu_seqlens=vision_kwargs["cu_seqlens"],
                max_seqlen=vision_kwargs.get("max_seqlen"),
                position_embeddings=(empty, empty),
                **passed,
            )
        return visual.merger(hidden)


#: the shard's precomputed metadata that transformers' vision forward consumes itself
_PRECOMPUTED = (
    "position_ids",
    "window_index",
    "cu_window_seqlens",
    "max_window_seqlen",
    "cu_seqlens",
    "max_seqlen",
)
