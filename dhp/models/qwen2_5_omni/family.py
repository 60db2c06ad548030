"""Qwen2.5-Omni's thinker as a :class:`~dhp.models.family.ModelFamily`: ``audio`` and ``vision`` -> ``llm``.

Checkpoint layouts: transformers 5's thinker (``model.audio_tower.*``, ``model.visual.*``,
``model.language_model.*``, ``lm_head.*``; what an HF export writes), the original thinker layout
(``audio_tower.*``, ``visual.*``, ``model.*``, ``lm_head.*``: what transformers' ``save_pretrained``
writes), and the released Qwen2.5-Omni checkpoints (``thinker.audio_tower.*``, ``thinker.visual.*``, ``thinker.model.*``, ``thinker.lm_head.*``,
or with transformers 5's ``thinker.model.<tower>.*``). The released directories also hold the speech
output (``talker.*``, ``token2wav.*``): those keys belong to modules this graph never builds
(``talker``, ``token2wav``, as Qwen3.5's ``mtp.*``), so loading reads none of them and reports none as
unexpected. An HF export (``dhp.checkpoint.export``) of a run from a thinker directory (or none)
writes the thinker: its config (``model_type: qwen2_5_omni_thinker``) and the reference thinker's
keys; from a full directory it rebuilds that directory: the trained thinker under the source's
``thinker.*`` names, the talker and token2wav tensors copied unchanged (``dhp.checkpoint.carried``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, Qwen2_5OmniConfig, Qwen2_5OmniThinkerConfig

from dhp.config.schema import ModelConfig
from dhp.errors import CheckpointError, DataError
from dhp.models.axes import runtime_plan
from dhp.models.checks import image_token_counts
from dhp.models.common import decoder_config, lm_head
from dhp.models.dtypes import torch_dtype
from dhp.models.family import HandOff, ModuleParallelPlan, ProducerShard
from dhp.models.family_base import FamilyBase
from dhp.models.qwen2_5_omni.arch import audio_axes, omni_llm_axes
from dhp.models.qwen2_5_omni.audio import audio_token_counts, shard_audio
from dhp.models.qwen2_5_omni.interleave import interleaved_ids
from dhp.models.qwen2_5_vision.sp import shard_vision_batch
from dhp.models.qwen2_5_vision.tp import vision_parallel_plan
from dhp.ops.packed import VIDEO, interleaved_videos
from dhp.parallel.llm_tp import decoder_tp_plan

#: ``SpecialTokens`` field -> the token's text in Qwen2.5-Omni's tokenizer
OMNI_TOKEN_STRINGS = {
    "image_token_id": "<|IMAGE|>",
    "video_token_id": "<|VIDEO|>",
    "vision_start_token_id": "<|vision_bos|>",
    "vision_end_token_id": "<|vision_eos|>",
    "audio_token_id": "<|AUDIO|>",
    "audio_start_token_id": "<|audio_bos|>",
    "audio_end_token_id": "<|audio_eos|>",
}


class Qwen25OmniFamily(FamilyBase):
    """Qwen2.5-Omni's thinker: ``audio`` (Whisper-style encoder) feeds ``audio_embeds`` and ``vision``
    (ViT + merger) feeds ``image_embeds`` to ``llm`` (decoder + lm_head)."""

    name = "qwen2_5_omni"
    module_names = ("audio", "vision", "llm")
    model_types = ("qwen2_5_omni_thinker", "qwen2_5_omni")
    #: first match wins: transformers 5's thinker, the original thinker layout (what ``save_pretrained``
    #: writes by default), a released full model, transformers 5's full model
    checkpoint_keys = (
        ("model.audio_tower.", "audio", "audio_tower."),
        ("model.visual.", "vision", "visual."),
        ("model.language_model.", "llm", "language_model."),
        ("lm_head.", "llm", "lm_head."),
        ("audio_tower.", "audio", "audio_tower."),
        ("visual.", "vision", "visual."),
        ("model.", "llm", "language_model."),
        ("thinker.model.audio_tower.", "audio", "audio_tower."),
        ("thinker.model.visual.", "vision", "visual."),
        ("thinker.model.language_model.", "llm", "language_model."),
        ("thinker.audio_tower.", "audio", "audio_tower."),
        ("thinker.visual.", "vision", "visual."),
        ("thinker.model.", "llm", "language_model."),
        ("thinker.lm_head.", "llm", "lm_head."),
        # the speech output of a released full model: modules outside this graph (never built or read)
        ("talker.", "talker", "talker."),
        ("token2wav.", "token2wav", "token2wav."),
    )

    def handoffs_for(self, hf_config: Qwen2_5OmniThinkerConfig) -> tuple[HandOff, ...]:
        """Two edges into the LLM: the audio rows at ``<|AUDIO|>``, the merger's rows at the image and
        video tokens."""
        width = hf_config.text_config.hidden_size
        return (
            HandOff("audio", "llm", "audio_embeds", "audio_tokens", width=width, grad=True),
            HandOff("vision", "llm", "image_embeds", "image_tokens", width=width, grad=True),
        )

    # --- producer inputs (driver side, pure) ---------------------------------------------------
    def shard_inputs(
        self,
        name: str,
        hf_config: Qwen2_5OmniThinkerConfig,
        *,
        sp_size: int,
        rows: torch.Tensor | None = None,
        meta: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> list[ProducerShard]:
        """The SP cut of producer ``name``'s items: ``rows``/``meta`` (audio: mel frames and frames per
        audio; vision: patches and grids; the vision keywords ``pixel_values``/``image_grid_thw`` too).
        Audio: whole chunks per rank, no collective (``audio.shard_audio``). Vision: the window-aligned
        Ulysses cut (``dhp.models.qwen2_5_vision.sp``)."""
        rows = pixel_values if rows is None else rows
        meta = image_grid_thw if meta is None else meta
        if name == "audio":
            return shard_audio(rows, meta, sp_size=sp_size, n_window=hf_config.audio_config.n_window)
        return shard_vision_batch(rows, meta, sp_size=sp_size, arch=hf_config.vision_config)

    def tokens_per_item(
        self, name: str, hf_config: Qwen2_5OmniThinkerConfig, meta: torch.Tensor
    ) -> list[int]:
        """Hand-off rows per item: an audio's ``audio_token_counts`` of its frames; an image's or video's
        ``t*h*w / merge**2``."""
        if name == "audio":
            return audio_token_counts(meta)
        return image_token_counts(meta, hf_config.vision_config.spatial_merge_size)

    def blank_input(
        self, name: str, hf_config: Qwen2_5OmniThinkerConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest valid input of producer ``name``: 4 zero mel frames (one audio row) with meta
        ``[[4]]``, or one merge unit of zero patches with grid ``[[1, m, m]]``."""
        if name == "audio":
            return torch.zeros(4, hf_config.audio_config.num_mel_bins), torch.tensor([[4]])
        return self.blank_image(hf_config)

    # --- data glue -------------------------------------------------------------------------------
    def token_strings(self) -> dict[str, str]:
        """The special tokens' text in Qwen2.5-Omni's tokenizer (``<|IMAGE|>``, ``<|AUDIO|>``, ...)."""
        return dict(OMNI_TOKEN_STRINGS)

    def video_with_audio_ids(
        self,
        hf_config: Qwen2_5OmniThinkerConfig,
        *,
        grid: tuple[int, int, int],
        seconds: float,
        audio_tokens: int,
    ) -> list[int]:
        """The token ids a video interleaved with its audio track takes between its vision-start and
        vision-end tokens, as ``Qwen2_5OmniProcessor`` writes them: audio-start, then per chunk of
        ``seconds_per_chunk`` (``position_id_per_seconds * seconds_per_chunk`` positions) the chunk's
        video tokens (each temporal grid at ``t * seconds * position_id_per_seconds``) and then its audio
        tokens (one position each), audio-end. ``grid``: the video's ``(t, h, w)`` patches; ``seconds``:
        seconds per temporal grid."""
        return interleaved_ids(
            grid=grid,
            merge=hf_config.vision_config.spatial_merge_size,
            seconds=seconds,
            audio_tokens=audio_tokens,
            position_id_per_seconds=hf_config.position_id_per_seconds,
            seconds_per_chunk=hf_config.seconds_per_chunk,
            ids=(
                hf_config.video_token_id,
                hf_config.audio_token_id,
                hf_config.audio_start_token_id,
                hf_config.audio_end_token_id,
            ),
        )

    def reference_kwargs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The whole batch's inputs as ``Qwen2_5OmniThinkerForConditionalGeneration.forward`` names them:
        ``video_second_per_grid`` for ``second_per_grid_ts``, no ``mm_token_type_ids`` (the thinker finds
        its placeholders by id), and its one ``use_audio_in_video`` per call, read from the tokens (a
        video token next to an audio token). DataError when the batch mixes videos with and without
        their audio (transformers takes one flag per call)."""
        out = {k: v for k, v in inputs.items() if v is not None and k != "mm_token_type_ids"}
        if "second_per_grid_ts" in out:
            out["video_second_per_grid"] = out.pop("second_per_grid_ts")
        types_ = inputs.get("mm_token_type_ids")
        if types_ is None:
            return out
        interleaved = interleaved_videos(types_)
        has_video = (types_ == VIDEO).any(dim=1)
        if bool((has_video & ~interleaved).any()) and bool(interleaved.any()):
            raise DataError(
                "the reference thinker takes one use_audio_in_video per call, but this batch holds videos with "
                "and without their audio track interleaved. Fix: compare batches of one kind, or train "
                "without the single-process reference."
            )
        out["use_audio_in_video"] = bool(interleaved.any())
        return out

    def load_audio_processor(self, model_path: str) -> Any:
        """transformers' ``WhisperFeatureExtractor`` of ``model_path``'s ``preprocessor_config.json``
        (16 kHz mono -> ``feature_size`` mel bins, hop 160: 100 frames per second)."""
        # reason: transformers' audio code loads only in a process that reads audio records
        from transformers import WhisperFeatureExtractor

        return WhisperFeatureExtractor.from_pretrained(model_path)

    # --- parallel plans -------------------------------------------------------------------------
    def parallel_plan(self, name: str, hf_config: Qwen2_5OmniThinkerConfig) -> ModuleParallelPlan:
        """Audio: FSDP blocks, no TP, SP over chunks without attention sites (no collective). Vision:
        TP by FQN (q/k/v column-parallel), Ulysses SP on the full-attention blocks' q, k, v. LLM: the
        decoder TP plan (with SP inside TP) and the loss."""
        if name == "audio":
            return runtime_plan(audio_axes(), blocks=("audio_tower.layers.*",))
        if name == "vision":
            return vision_parallel_plan(hf_config.vision_config, fused_qkv=False)
        t = hf_config.text_config
        tied = self.tied_parameters(name, hf_config)
        axes = omni_llm_axes(
            heads=t.num_attention_heads,
            kv_heads=t.num_key_value_heads,
            vocab=t.vocab_size,
            mlp=t.intermediate_size,
            layers=t.num_hidden_layers,
            tied=bool(tied),
        )
        return runtime_plan(
            axes,
            blocks=("language_model.layers.*",),
            tp=lambda sequence_parallel: decoder_tp_plan(
                model="language_model", lm_head="lm_head", sequence_parallel=sequence_parallel
            ),
            loss=True,
            tied=tied,
            pad_token_id=t.pad_token_id,
        )

    # --- configs -------------------------------------------------------------------------------
    def hf_config(self, model_cfg: ModelConfig) -> Qwen2_5OmniThinkerConfig:
        """Build the thinker's transformers config from the schema's numbers (no file is read)."""
        a, v, t, tok = model_cfg.audio, model_cfg.vision, model_cfg.llm, model_cfg.tokens
        audio = dict(
            d_model=a.hidden_size,
            encoder_layers=a.depth,
            encoder_attention_heads=a.num_heads,
            encoder_ffn_dim=a.intermediate_size,
            num_mel_bins=a.num_mel_bins,
            n_window=a.n_window,
            max_source_positions=a.max_source_positions,
            output_dim=t.hidden_size,
        )
        vision = dict(
            depth=v.depth,
            hidden_size=v.hidden_size,
            num_heads=v.num_heads,
            intermediate_size=v.intermediate_size,
            patch_size=v.patch_size,
            spatial_merge_size=v.spatial_merge_size,
            temporal_patch_size=v.temporal_patch_size,
            window_size=v.extra["window_size"],
            in_channels=v.in_channels,
            fullatt_block_indexes=list(v.extra["fullatt_block_indexes"]),
            out_hidden_size=t.hidden_size,
            hidden_act="silu",
        )
        text = decoder_config(
            vocab=t.vocab_size,
            hidden=t.hidden_size,
            layers=t.num_layers,
            heads=t.num_heads,
            kv_heads=t.num_kv_heads,
            rms_norm_eps=t.rms_norm_eps,
            max_position_embeddings=t.max_position_embeddings,
            rope_theta=t.rope_theta,
            mrope_section=list(t.extra["mrope_section"]),
        ) | dict(
            intermediate_size=t.intermediate_size,
            tie_word_embeddings=t.tie_word_embeddings,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        return Qwen2_5OmniThinkerConfig(
            architectures=["Qwen2_5OmniThinkerForConditionalGeneration"],
            audio_config=audio,
            vision_config=vision,
            text_config=text,
            audio_token_index=tok.audio_token_id,
            image_token_index=tok.image_token_id,
            video_token_index=tok.video_token_id,
            audio_start_token_id=tok.audio_start_token_id,
            audio_end_token_id=tok.audio_end_token_id,
            vision_start_token_id=tok.vision_start_token_id,
            vision_end_token_id=tok.vision_end_token_id,
            position_id_per_seconds=t.extra["position_id_per_seconds"],
            seconds_per_chunk=t.extra["seconds_per_chunk"],
            tie_word_embeddings=t.tie_word_embeddings,
            attn_implementation=model_cfg.attn_implementation,
            dtype=torch_dtype(model_cfg.dtype),
        )

    def read_hf_config(self, model_type: str, path: Path, raw: Mapping[str, Any]) -> PretrainedConfig:
        """``qwen2_5_omni_thinker``: the thinker's config; ``qwen2_5_omni``: the full model's
        ``thinker_config`` (the talker's and token2wav's are not read)."""
        if model_type == "qwen2_5_omni":
            cfg = Qwen2_5OmniConfig.from_pretrained(str(path)).thinker_config
        else:
            cfg = Qwen2_5OmniThinkerConfig.from_pretrained(str(path))
        if getattr(cfg, "vision_start_token_id", None) is None:  # not a declared field of the class
            raise CheckpointError(
                f"{path}/config.json: the thinker config has no vision_start_token_id, which TMRoPE reads "
                "to find each image and video. Fix: add the tokenizer's <|vision_bos|> id (151652 in the "
                "released checkpoints) to the thinker config."
            )
        return cfg

    # --- modules -------------------------------------------------------------------------------
    def new_module(
        self,
        name: str,
        hf_config: Qwen2_5OmniThinkerConfig,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> nn.Module:
        """transformers' audio encoder, vision encoder or decoder (+ ``lm_head``) in this family's wrapper."""
        # reason: transformers' model code costs seconds to import; the driver reads this family's
        # names, configs and hand-offs but builds nothing, so only what builds a module loads it
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniAudioEncoder,
            Qwen2_5OmniThinkerTextModel,
            Qwen2_5OmniVisionEncoder,
        )

        from dhp.models.qwen2_5_omni.modules import AudioModule, LLMModule, VisionModule

        if name == "audio":
            return AudioModule(Qwen2_5OmniAudioEncoder._from_config(hf_config.audio_config, dtype=dtype))
        if name == "vision":
            return VisionModule(Qwen2_5OmniVisionEncoder._from_config(hf_config.vision_config, dtype=dtype))
        text_cfg = hf_config.text_config
        language_model = Qwen2_5OmniThinkerTextModel._from_config(text_cfg, dtype=dtype)
        return LLMModule(language_model, lm_head(text_cfg, device=device, dtype=dtype), hf_config)

    def init_buffers(self, name: str, module: nn.Module) -> None:
        """The rotary buffers (vision, LLM) as the base does; the audio encoder's sinusoidal position
        table (a non-persistent buffer) recomputed as transformers' init does."""
        if name != "audio":
            super().init_buffers(name, module)
            return
        table = module.audio_tower.positional_embedding
        with torch.no_grad():
            table.positional_embedding.copy_(table.compute_default_singular_positional_embedding())

    def reference_class(self, hf_config: Qwen2_5OmniThinkerConfig) -> type[nn.Module]:
        """``Qwen2_5OmniThinkerForConditionalGeneration``."""
        # reason: transformers' model code costs seconds to import (see new_module)
        from transformers import Qwen2_5OmniThinkerForConditionalGeneration

        return Qwen2_5OmniThinkerForConditionalGeneration


FAMILY = Qwen25OmniFamily
