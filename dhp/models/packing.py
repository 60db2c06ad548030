"""Packed LLM rows for every family: per-sample M-RoPE positions and attention that never crosses samples.

A packed row (``attention_mask`` values = sample index per token, 0 = padding; see
``dhp.data.packing``) is handed to transformers' own text model in its documented packed form:
``position_ids`` of shape ``(4, B, S)`` whose first row is the text position (restarting at 0 for
every sample and every padding run) and whose last three rows are the M-RoPE positions that the
family's own ``LLMModule.positions`` (transformers' ``get_rope_index``) gives each sample alone.

The text model's ``attention_mask`` (:func:`packed_text_mask`):

- an all-attention decoder (Qwen2.5-VL, Qwen3-VL and its MoE flavour): None; from the restarting text
  positions transformers builds a block-diagonal causal mask (eager/SDPA, also on CPU);
- a hybrid decoder (``layer_types`` with ``linear_attention``: Qwen3.5): the per-layer-type mapping
  transformers takes as given, ``{"full_attention": <the mask transformers' own create_causal_mask
  builds from the same restarting text positions>, "linear_attention": <the row's sample ids>}``; the
  Gated DeltaNet layers read the sample ids and run once per sample
  (``dhp.parallel.linear_attn_packed``). The ids travel as an argument of every decoder layer, so
  activation checkpointing's recompute sees them too;
- under context parallelism: the module's own context mask (``LLMBase.text_mask``), which is exact for
  packed rows already (it masks by sample id).

For flash attention (no context parallelism) :func:`varlen_kwargs` adds the varlen ``cu_seq_lens_q/k``
and ``max_length_q/k`` over the flattened ``B x S`` tokens, so flash runs ``flash_attn_varlen_func``
with one sequence per sample. Under sequence parallelism inside TP the positions and ``cu_seqlens``
describe the full (padded) sequence, which is what the attention sees after its all-gather. The vision
side is unchanged: each image keeps its own ``cu_seqlens`` in the encoder.

Memory: the ``(4, B, S)`` positions and, for a hybrid decoder, one ``(B, 1, S, S)`` boolean mask of
the full-attention layers (SDPA; none for flash), as transformers builds for any padded batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.masking_utils import create_causal_mask

from dhp.errors import DataError
from dhp.ops.packed import IMAGE, VIDEO, segments

#: ``positions(*, input_ids, attention_mask, mm_token_type_ids, image_grid_thw, **video) -> (3, 1, S_i)``:
#: the family's unpacked M-RoPE positions of one sample (its ``LLMModule.positions``)
PositionsFn = Callable[..., torch.Tensor]

#: the layer type of a hybrid decoder's linear-attention layers in transformers' ``layer_types``
LINEAR_ATTENTION = "linear_attention"


def packed_positions(
    *,
    positions: PositionsFn,
    merge: int,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    **video: torch.Tensor | None,
) -> torch.Tensor:
    """``(4, B, S)`` positions: text positions per sample, then each sample's own M-RoPE ``(3, S_i)``.

    ``positions`` is the family's unpacked position function; ``merge`` the merged patches per vision
    token (``spatial_merge_size ** 2``; 1 without a vision tower). Image grids are consumed in
    row-major sample order; ``video`` (``video_grid_thw`` and ``second_per_grid_ts``) likewise, when
    given.
    """
    grids = {"image": _Cursor(image_grid_thw, merge)}
    if video.get("video_grid_thw") is not None:  # optional forward inputs, not config
        grids["video"] = _Cursor(video["video_grid_thw"], merge, video.get("second_per_grid_ts"))
    batch, seq = input_ids.shape
    out = torch.empty((4, batch, seq), dtype=torch.long, device=input_ids.device)
    for r in range(batch):
        for start, end, seg in segments(attention_mask[r]):
            out[0, r, start:end] = torch.arange(end - start, device=input_ids.device)
            if seg == 0:  # padding: its own run, plain positions, never attended by a sample
                out[1:, r, start:end] = out[0, r, start:end]
                continue
            types = mm_token_type_ids[r : r + 1, start:end]
            kwargs: dict[str, Any] = {"image_grid_thw": grids["image"].take(int((types == IMAGE).sum()))}
            if "video" in grids:
                kwargs["video_grid_thw"], kwargs["second_per_grid_ts"] = grids["video"].take_video(
                    int((types == VIDEO).sum())
                )
            pos = positions(
                input_ids=input_ids[r : r + 1, start:end],
                attention_mask=torch.ones_like(types),
                mm_token_type_ids=types,
                **kwargs,
            )
            out[1:, r, start:end] = pos[:, 0]
    return out


def varlen_kwargs(attention_mask: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """Flash-attention varlen kwargs over the flattened ``B x S`` tokens: one sequence per sample and
    per padding run (``cu_seq_lens_q/k`` int32, ``max_length_q/k``)."""
    bounds = [0]
    longest = 0
    seq = attention_mask.shape[1]
    for r in range(attention_mask.shape[0]):
        for start, end, _ in segments(attention_mask[r]):
            bounds.append(r * seq + end)
            longest = max(longest, end - start)
    cu = torch.tensor(bounds, dtype=torch.int32, device=attention_mask.device)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def is_hybrid(text_config: Any) -> bool:
    """True for a decoder with linear-attention layers (transformers' ``layer_types``)."""
    return LINEAR_ATTENTION in set(getattr(text_config, "layer_types", None) or ())


def packed_text_mask(
    module: Any, attention_mask: torch.Tensor, *, inputs_embeds: torch.Tensor, text_positions: torch.Tensor
) -> torch.Tensor | dict[str, torch.Tensor | None] | None:
    """The text model's ``attention_mask`` for a packed micro-batch of ``module`` (an ``LLMBase``):
    None, the hybrid decoder's per-layer-type mapping, or the context mask (module docstring).
    ``text_positions``: the ``(B, S)`` first row of :func:`packed_positions` (whole sequence)."""
    if module.context_shard is not None:  # sample ids in the context mask (and the DeltaNet's entry)
        return module.text_mask(attention_mask)
    config = module.language_model.config
    if not is_hybrid(config):
        return None  # transformers builds the block-diagonal mask from the restarting text positions
    full = create_causal_mask(
        config=config,
        inputs_embeds=inputs_embeds,
        attention_mask=None,
        cache=None,
        position_ids=text_positions,
    )
    return {"full_attention": full, LINEAR_ATTENTION: attention_mask}


def packed_decoder_inputs(
    module: Any,
    *,
    inputs_embeds: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    **video: torch.Tensor | None,
) -> tuple[torch.Tensor, Any, dict[str, Any]]:
    """``(position_ids, attention_mask, extra kwargs)`` for the text model on a packed micro-batch of
    ``module`` (a family's ``LLMBase`` with ``positions``): the ``(4, B, S)`` positions (this rank's
    tokens under context parallelism), :func:`packed_text_mask`, and the flash varlen kwargs when the
    text model runs a flash kernel (none under context parallelism, whose attention is its own)."""
    if mm_token_type_ids is None:  # text-only config: no image can be present (checked in embed)
        mm_token_type_ids = torch.zeros_like(input_ids)
    encoder = None if module.vl_config is None else module.vl_config.vision_config
    position_ids = packed_positions(
        positions=module.positions,
        merge=1 if encoder is None else encoder.spatial_merge_size**2,
        input_ids=input_ids,
        attention_mask=attention_mask,
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=image_grid_thw,
        **video,
    )
    mask = packed_text_mask(
        module, attention_mask, inputs_embeds=inputs_embeds, text_positions=position_ids[0]
    )
    if module.context_shard is not None:
        return module.cut(position_ids, dim=-1), mask, {}
    impl = module.language_model.config._attn_implementation or ""
    return position_ids, mask, (varlen_kwargs(attention_mask) if "flash" in impl else {})


class _Cursor:
    """Walks grid rows in order, handing each sample the grids whose merged tokens it holds."""

    def __init__(self, grids: torch.Tensor | None, merge: int, seconds: torch.Tensor | None = None) -> None:
        self.grids = grids
        self.tokens = [] if grids is None else (grids.prod(dim=1) // merge).tolist()
        self.seconds = seconds
        self.at = 0

    def _advance(self, tokens: int) -> slice:
        begin, got = self.at, 0
        while got < tokens and self.at < len(self.tokens):
            got += self.tokens[self.at]
            self.at += 1
        if got != tokens:
            raise DataError(
                f"a packed sample holds {tokens} image/video tokens but the grids in order give {got}. "
                "Fix: pack grids in the samples' row-major order (dhp.data.packing.pack does)"
            )
        return slice(begin, self.at)

    def take(self, tokens: int) -> torch.Tensor | None:
        if tokens == 0:
            return None
        return self.grids[self._advance(tokens)]

    def take_video(self, tokens: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if tokens == 0:
            return None, None
        sl = self._advance(tokens)
        return self.grids[sl], None if self.seconds is None else self.seconds[sl]


__all__ = [
    "LINEAR_ATTENTION",
    "PositionsFn",
    "is_hybrid",
    "packed_decoder_inputs",
    "packed_positions",
    "packed_text_mask",
    "varlen_kwargs",
]
