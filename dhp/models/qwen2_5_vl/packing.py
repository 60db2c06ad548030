"""Packed LLM rows for Qwen2.5-VL: per-sample M-RoPE positions and attention that never crosses samples.

A packed row (``attention_mask`` values = sample index per token, 0 = padding; see
``dhp.data.packing``) is handed to transformers' own text model in its documented packed form:
``position_ids`` of shape ``(4, B, S)`` whose first row is the text position (restarting at 0 for
every sample and every padding run) and whose last three rows are the M-RoPE positions that
``get_rope_index`` gives each sample alone, with ``attention_mask=None``. From the restarting text
positions transformers builds a block-diagonal causal mask (eager/SDPA, also on CPU). For flash
attention this module adds the varlen ``cu_seq_lens_q/k`` and ``max_length_q/k`` over the flattened
``B x S`` tokens, so flash runs ``flash_attn_varlen_func`` with one sequence per sample.

Under sequence parallelism inside TP the positions and ``cu_seqlens`` describe the full (padded)
sequence, which is what the attention sees after its all-gather. The vision side is unchanged: each
image keeps its own ``cu_seqlens`` in the encoder.
"""

from __future__ import annotations

import torch
from transformers import Qwen2_5_VLConfig

from dhp.ops.packed import IMAGE, VIDEO, segments


def packed_positions(
    *,
    config: Qwen2_5_VLConfig | None,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    mrope_fn,
    **video,
) -> torch.Tensor:
    """``(4, B, S)`` positions: text positions per sample, then each sample's own M-RoPE ``(3, S_i)``.

    ``mrope_fn`` is the unpacked ``(3, 1, S_i)`` position function (``modules.mrope_positions``).
    Image grids are consumed in row-major sample order; ``video`` (``video_grid_thw`` and
    ``second_per_grid_ts``) likewise, when given.
    """
    merge = 1 if config is None else config.vision_config.spatial_merge_size**2
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
            kwargs = {}
            kwargs["image_grid_thw"] = grids["image"].take(int((types == IMAGE).sum()))
            if "video" in grids:
                kwargs["video_grid_thw"], kwargs["second_per_grid_ts"] = grids["video"].take_video(
                    int((types == VIDEO).sum())
                )
            pos = mrope_fn(
                config=config,
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


def packed_llm_inputs(
    module, *, input_ids, attention_mask, mm_token_type_ids, image_grid_thw, **video
) -> tuple[torch.Tensor, dict]:
    """``(position_ids (4, B, S), extra language-model kwargs)`` for a packed micro-batch of
    ``module`` (the LLMModule); the caller passes ``attention_mask=None`` to the text model."""
    from dhp.models.qwen2_5_vl.modules import mrope_positions

    if mm_token_type_ids is None:  # text-only config: no image can be present (checked in embed)
        mm_token_type_ids = torch.zeros_like(input_ids)
    position_ids = packed_positions(
        config=module.vl_config,
        input_ids=input_ids,
        attention_mask=attention_mask,
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=image_grid_thw,
        mrope_fn=mrope_positions,
        **video,
    )
    impl = module.language_model.config._attn_implementation or ""
    return position_ids, (varlen_kwargs(attention_mask) if "flash" in impl else {})


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
            from dhp.errors import DataError

            raise DataError(
                f"a packed sample holds {tokens} vision tokens but the grids in order give {got}. "
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
