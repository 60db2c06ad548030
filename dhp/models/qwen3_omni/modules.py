"""Qwen3-Omni's thinker cut into modules: the audio encoder (``audio.py``), the shared Qwen3 vision
wrapper, and the LLM here (this module loads transformers' model code).

Everything wraps transformers' own, unmodified classes. The LLM does what
``Qwen3OmniMoeThinkerModel.forward`` does after its encoders: ``audio_embeds`` (audio after audio) at
the audio-token positions, ``image_embeds`` (images and videos, one ordered stream) at the image and
video positions, the DeepStack features added at those same positions after the first decoder layers
(transformers joins the image and the video features in token order: the stream's order), then TMRoPE
positions from transformers' own ``get_rope_index``, called sample by sample (it takes one
``use_audio_in_video`` per call; dhp's batch has one per sample). The router's load-balancing loss is
the shared Qwen3 LLM's (``dhp/models/qwen3_base/llm.py``). No state is kept between calls.
"""

from __future__ import annotations

import itertools
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder,
    Qwen3OmniMoePreTrainedModelForConditionalGeneration,
    Qwen3OmniMoeThinkerForConditionalGeneration,
    Qwen3OmniMoeThinkerTextModel,
    Qwen3OmniMoeVisionEncoder,
)

from dhp.errors import DataError
from dhp.models.checks import check_image_alignment
from dhp.models.common import TextCall, sample_names, scatter_rows
from dhp.models.family import StepStatistics
from dhp.models.qwen3_base.llm import LLMModule as Qwen3LLMModule
from dhp.models.qwen3_omni.audio import AudioModule, audio_token_counts
from dhp.models.qwen3_vision.modules import VisionModule
from dhp.ops.packed import AUDIO, IMAGE, TEXT, VIDEO, is_packed

__all__ = ["CLASSES", "AudioModule", "LLMModule", "VisionModule", "tmrope_positions"]


@dataclass(frozen=True)
class OmniClasses:
    """The transformers classes the thinker builds; ``rope_model`` holds ``get_rope_index``."""

    audio: type[nn.Module]
    vision: type[nn.Module]
    text: type[nn.Module]
    rope_model: type
    reference: type[nn.Module]


CLASSES = OmniClasses(
    audio=Qwen3OmniMoeAudioEncoder,
    vision=Qwen3OmniMoeVisionEncoder,
    text=Qwen3OmniMoeThinkerTextModel,
    rope_model=Qwen3OmniMoePreTrainedModelForConditionalGeneration,
    reference=Qwen3OmniMoeThinkerForConditionalGeneration,
)


class LLMModule(Qwen3LLMModule):
    """The Qwen3 MoE LLM (token embeddings, decoder layers with DeepStack additions, norm, lm_head, LM
    loss + weighted load-balancing loss) with the audio rows placed and TMRoPE positions.

    Placement: one actor group; memory is dominated by the routed experts (``dhp/parallel`` shards them
    by EP) and the other model states (TP/FSDP). ``config``: the thinker's config.
    """

    def prepare(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        mm_token_type_ids: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        audio_embeds: torch.Tensor | None = None,
        audio_lens: torch.Tensor | None = None,
        use_audio_in_video: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        sample_ids: list[str] | None = None,
        batch_statistics: bool = False,
        step_statistics: StepStatistics | None = None,
        hidden_states: torch.Tensor | None = None,
        **deepstack_embeds: torch.Tensor,
    ) -> TextCall:
        """One micro-batch's text-model call (``forward`` = prepare, the text model, ``finish``: the
        shared Qwen3 LLM's loss and router term).

        ``mm_token_type_ids`` (0 text, 1 image, 2 video, 3 audio) is required with any image, video or
        audio. ``image_grid_thw``/``image_embeds``/``deepstack_embeds_k``: every visual item (images and
        videos) in token order; ``audio_embeds``/``audio_lens`` (mel frames per audio): every audio in
        token order, a video's own audio track included; ``use_audio_in_video`` (B,) bool, optional:
        whether the sample's videos are interleaved with their audio tracks, which the tokens say
        themselves (read from them; a given flag is checked against them); ``second_per_grid_ts``: one
        per video. Make the embeddings leaves with ``requires_grad`` to receive their gradients.
        DataError when tokens and rows disagree, for a packed micro-batch and under context parallelism
        (neither is declared). ``hidden_states`` (a later pipeline stage) replaces the embeddings.
        """
        sample_ids = sample_names(input_ids, sample_ids)
        if self.context_shard is not None or is_packed(attention_mask):
            raise DataError(
                f"samples {sample_ids}: the {self._family} LLM has no context parallelism and no packing "
                "(TMRoPE and the audio placement are proven only on unpacked rows). Fix: set "
                "modules.llm.parallel.cp to 1 and data.packing to false."
            )
        flags = _flags(use_audio_in_video, input_ids, self.vl_config, sample_ids)
        deepstack = self.deepstack_list(image_embeds, deepstack_embeds, sample_ids)
        inputs_embeds = hidden_states
        if hidden_states is None:
            inputs_embeds = self.embed_all(
                input_ids=input_ids,
                mm_token_type_ids=mm_token_type_ids,
                image_grid_thw=image_grid_thw,
                image_embeds=image_embeds,
                audio_embeds=audio_embeds,
                audio_lens=audio_lens,
                sample_ids=sample_ids,
            )
        position_ids = tmrope_positions(
            config=self.vl_config,
            input_ids=input_ids,
            attention_mask=attention_mask,
            kinds=_visual_kinds(input_ids, mm_token_type_ids),
            grids=image_grid_thw,
            audio_lens=audio_lens,
            use_audio_in_video=flags,
            second_per_grid_ts=second_per_grid_ts,
            sample_ids=sample_ids,
        )
        extra: dict[str, Any] = {"output_router_logits": True}  # every router's [B*S, E] logits
        if deepstack is not None:  # added at the image and video tokens after the first K layers
            extra.update(visual_pos_masks=self.placed(input_ids), deepstack_visual_embeds=deepstack)
        kwargs = dict(attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **extra)
        state = dict(batch_statistics=batch_statistics, step=step_statistics, attention_mask=attention_mask)
        return TextCall(inputs_embeds=inputs_embeds, kwargs=kwargs, labels=labels, state=state)

    def placed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Images and videos are one ordered stream of visual items: both take the vision rows."""
        return (input_ids == self.vl_config.image_token_id) | (input_ids == self.vl_config.video_token_id)

    def embed_all(
        self,
        *,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        image_embeds: torch.Tensor | None,
        audio_embeds: torch.Tensor | None,
        audio_lens: torch.Tensor | None,
        sample_ids: list[str],
    ) -> torch.Tensor:
        """Token embeddings ``(B, S, H)`` with the vision rows at the image and video tokens and the audio
        rows at the audio tokens (the masks are disjoint), after checking tokens against rows."""
        if mm_token_type_ids is None:
            if image_embeds is not None or audio_embeds is not None:
                raise DataError(
                    f"samples {sample_ids}: mm_token_type_ids is missing. TMRoPE and the placement of image, "
                    "video and audio rows depend on it. Fix: pass mm_token_type_ids (0 text, 1 image, "
                    "2 video, 3 audio) as dhp.data's VLBatch does."
                )
            mm_token_type_ids = torch.zeros_like(input_ids)
        pad = self.vl_config.text_config.pad_token_id
        ids, types_ = without_audio(input_ids, mm_token_type_ids, pad=0 if pad is None else int(pad))
        check_image_alignment(
            input_ids=ids,
            mm_token_type_ids=types_,
            image_grid_thw=image_grid_thw,
            image_embeds=image_embeds,
            config=self.vl_config,
            sample_ids=sample_ids,
        )
        check_audio_alignment(
            input_ids=input_ids,
            mm_token_type_ids=mm_token_type_ids,
            audio_embeds=audio_embeds,
            audio_lens=audio_lens,
            config=self.vl_config,
            sample_ids=sample_ids,
        )
        inputs_embeds = self.language_model.embed_tokens(input_ids)
        if image_embeds is not None:
            inputs_embeds = scatter_rows(inputs_embeds, self.placed(input_ids), image_embeds)
        if audio_embeds is not None:
            inputs_embeds = scatter_rows(
                inputs_embeds, input_ids == self.vl_config.audio_token_id, audio_embeds
            )
        return inputs_embeds


def check_audio_alignment(
    *,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    audio_embeds: torch.Tensor | None,
    audio_lens: torch.Tensor | None,
    config: Qwen3OmniMoeThinkerConfig,
    sample_ids: list[str],
) -> None:
    """Audio tokens, ``mm_token_type_ids == 3``, ``audio_lens`` and the rows must agree sample by sample:
    sample b's k audio-start tokens take the next k audios, whose token counts must sum to its audio
    tokens. DataError naming the sample otherwise."""
    is_audio = input_ids == config.audio_token_id
    n_tokens = int(is_audio.sum())
    if n_tokens == 0 and audio_embeds is None:
        return
    if not torch.equal(is_audio, mm_token_type_ids == AUDIO):
        raise DataError(
            f"samples {sample_ids}: the {n_tokens} audio tokens (id {config.audio_token_id}) are not the "
            f"positions marked {AUDIO} in mm_token_type_ids. Fix: derive mm_token_type_ids from input_ids "
            "(dhp.data does)."
        )
    lens = torch.zeros(0, dtype=torch.long) if audio_lens is None else audio_lens.reshape(-1).cpu()
    per_audio = audio_token_counts(lens, n_window=config.audio_config.n_window)
    rows = 0 if audio_embeds is None else int(audio_embeds.shape[0])
    if rows != sum(per_audio) or rows != n_tokens:
        raise DataError(
            f"samples {sample_ids}: {n_tokens} audio tokens, audio_lens {lens.tolist()} give "
            f"{sum(per_audio)} audio rows, {rows} audio_embeds rows were given. Fix: pass the audio "
            "encoder's output for exactly these audios and one audio token per row."
        )
    if audio_embeds is not None and audio_embeds.shape[-1] != config.text_config.hidden_size:
        raise DataError(
            f"audio_embeds has width {audio_embeds.shape[-1]} but the LLM hidden size is "
            f"{config.text_config.hidden_size}. Fix: the audio encoder's output_dim must equal the LLM's."
        )
    cursor = 0
    for b, sample in enumerate(sample_ids):
        k = int((input_ids[b] == config.audio_start_token_id).sum())
        mine = per_audio[cursor : cursor + k]
        if len(mine) < k or sum(mine) != int(is_audio[b].sum()):
            raise DataError(
                f"sample {sample}: {int(is_audio[b].sum())} audio tokens after {k} audio-start tokens but "
                f"its audios give {sum(mine)} rows (per audio {mine}). Fix: re-run the processor on this "
                "sample; never truncate an audio's tokens."
            )
        cursor += k
    if cursor != len(per_audio):
        raise DataError(
            f"samples {sample_ids}: {cursor} audios have tokens but audio_lens lists {len(per_audio)}. "
            "Fix: drop the audios without tokens, or add their tokens."
        )


def _flags(
    use_audio_in_video: torch.Tensor | None,
    input_ids: torch.Tensor,
    config: Qwen3OmniMoeThinkerConfig,
    sample_ids: list[str],
) -> list[bool]:
    """One ``use_audio_in_video`` per sample, read from its tokens: the processor writes a video with
    its audio track as ``<|vision_start|><|audio_start|>...``, a video alone as
    ``<|vision_start|><|video_pad|>``. DataError when a sample holds both kinds (transformers' TMRoPE
    positions a sample's videos one way), or when a given ``use_audio_in_video`` (B,) is set for a
    sample whose tokens hold no interleaved video."""
    starts = input_ids[:, :-1] == config.vision_start_token_id
    after, rows = input_ids[:, 1:][starts], starts.nonzero()[:, 0]
    flags = []
    for b, sample in enumerate(sample_ids):
        follow = after[rows == b]
        with_audio = bool((follow == config.audio_start_token_id).any())
        if with_audio and bool((follow == config.video_token_id).any()):
            raise DataError(
                f"sample {sample}: a video with its audio track interleaved and a video without one. "
                "TMRoPE positions every video of a sample the same way. Fix: use the audio track of every "
                "video of this sample (use_audio_in_video) or of none."
            )
        flags.append(with_audio)
    if use_audio_in_video is not None:
        given = [bool(f) for f in torch.as_tensor(use_audio_in_video).reshape(-1).tolist()]
        if len(given) != len(flags):
            raise DataError(
                f"use_audio_in_video has {len(given)} entries for {len(flags)} samples. Fix: one per sample."
            )
        wrong = [s for s, g, f in zip(sample_ids, given, flags, strict=True) if g and not f]
        if wrong:
            raise DataError(
                f"samples {wrong}: use_audio_in_video is set but no video of theirs has its audio track "
                "interleaved (<|vision_start|><|audio_start|>). Fix: build the tokens with the video's audio "
                "(dhp.data does when the record sets use_audio_in_video)."
            )
    return flags


def without_audio(
    input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, *, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, mm_token_type_ids)`` with every audio position removed from each row (rows padded
    at the end), for the image and video checks: a video interleaved with its audio track is one run
    of video tokens there, as its grid describes it."""
    keep = mm_token_type_ids != AUDIO
    ids = torch.full_like(input_ids, pad)
    types_ = torch.full_like(mm_token_type_ids, TEXT)
    for b in range(input_ids.shape[0]):
        n = int(keep[b].sum())
        ids[b, :n] = input_ids[b][keep[b]]
        types_[b, :n] = mm_token_type_ids[b][keep[b]]
    return ids, types_


def _visual_kinds(input_ids: torch.Tensor, types_: torch.Tensor | None) -> list[list[int]]:
    """Per sample, the kind (1 image, 2 video) of each visual item in token order: runs of image or
    video tokens, audio positions skipped (a video interleaved with its audio is one item)."""
    if types_ is None:
        return [[] for _ in range(input_ids.shape[0])]
    out = []
    for row in types_.tolist():
        visual = [t for t in row if t in (IMAGE, VIDEO, TEXT)]
        out.append([k for k, _ in itertools.groupby(visual) if k != TEXT])
    return out


def tmrope_positions(
    *,
    config: Qwen3OmniMoeThinkerConfig,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    kinds: list[list[int]],
    grids: torch.Tensor | None,
    audio_lens: torch.Tensor | None,
    use_audio_in_video: list[bool],
    second_per_grid_ts: torch.Tensor | None,
    sample_ids: list[str],
) -> torch.Tensor:
    """``(3, B, S)`` TMRoPE positions computed by transformers' ``get_rope_index`` itself, one sample at
    a time (each with its own ``use_audio_in_video``, its grids split into images and videos by
    ``kinds``, its videos' seconds per grid and its audios' mel frames). The method reads only the
    config, the merge size and ``get_llm_pos_ids_for_vision`` (which ignores ``self``)."""
    cls = CLASSES.rope_model
    stand_in = types.SimpleNamespace(
        config=config,
        spatial_merge_size=config.vision_config.spatial_merge_size,
        get_llm_pos_ids_for_vision=lambda *a: cls.get_llm_pos_ids_for_vision(None, *a),
    )
    lens = torch.zeros(0, dtype=torch.long) if audio_lens is None else audio_lens.reshape(-1).cpu()
    n_items = sum(len(k) for k in kinds)
    have = 0 if grids is None else grids.shape[0]
    if n_items != have:
        raise DataError(
            f"samples {sample_ids}: {n_items} visual token runs (images + videos) but {have} grids. Fix: keep "
            "one grid per image or video, in the order of their tokens (dhp.data does)."
        )
    n_videos = sum(k == VIDEO for row in kinds for k in row)
    seconds = None if second_per_grid_ts is None else second_per_grid_ts.reshape(-1).cpu()
    if n_videos and (seconds is None or seconds.numel() != n_videos):
        got = None if seconds is None else seconds.numel()
        raise DataError(
            f"samples {sample_ids}: {n_videos} video(s) but second_per_grid_ts has {got} entries. Fix: pass "
            "one second_per_grid_ts per video (temporal_patch_size / sampled fps)."
        )
    rows, item, video, audio = [], 0, 0, 0
    for b, row_kinds in enumerate(kinds):
        mine = grids[item : item + len(row_kinds)].cpu() if row_kinds else None
        is_video = torch.tensor([k == VIDEO for k in row_kinds], dtype=torch.bool)
        n_vid, n_aud = int(is_video.sum()), int((input_ids[b] == config.audio_start_token_id).sum())
        if use_audio_in_video[b] and n_vid > n_aud:
            raise DataError(
                f"sample {sample_ids[b]}: use_audio_in_video with {n_vid} video(s) but {n_aud} audio(s). "
                "Fix: give every video its audio track, or set use_audio_in_video false for this sample."
            )
        images = mine[~is_video] if mine is not None and (~is_video).any() else None
        videos = mine[is_video] if mine is not None and is_video.any() else None
        position_ids, _ = cls.get_rope_index(
            stand_in,
            input_ids[b : b + 1].cpu(),
            image_grid_thw=images,
            video_grid_thw=videos,
            attention_mask=attention_mask[b : b + 1].cpu(),
            use_audio_in_video=use_audio_in_video[b],
            audio_seqlens=lens[audio : audio + n_aud],
            second_per_grids=None if seconds is None else seconds[video : video + n_vid],
        )
        rows.append(position_ids)
        item, video, audio = item + len(row_kinds), video + n_vid, audio + n_aud
    return torch.cat(rows, dim=1).to(input_ids.device)
