"""Qwen3-Omni's thinker as a :class:`~dhp.models.family.ModelFamily`: ``audio`` and ``vision`` -> ``llm``.

A declaration on the Qwen3 base (``dhp/models/qwen3_base/base_family.py``: the vision edges
``image_embeds`` + one ``deepstack_embeds_k`` per DeepStack level, their SP cut, the Qwen3 MoE
decoder's ``text_config``, TP plan and expert blocks) with the audio encoder added: the ``audio_embeds``
edge (layout ``audio_tokens``), its window-aligned SP cut (``audio.shard_audio``) and the thinker's
config. The thinker is MoE only (``qwen3_omni_moe_thinker``); a full ``qwen3_omni_moe`` directory is
read for its ``thinker_config``.

Checkpoint layouts: transformers 5's thinker (``model.audio_tower.*``, ``model.visual.*``,
``model.language_model.*``, ``lm_head.*``: what ``save_pretrained`` and an HF export write) and the
full model's (``thinker.model.<tower>.*``, or the released ``thinker.audio_tower.*``,
``thinker.visual.*``, ``thinker.model.*``, ``thinker.lm_head.*``); the speech output (``talker.*``,
``code2wav.*``) belongs to modules this graph never builds, so loading reads none of it and an HF
export from a full directory copies it unchanged beside the trained thinker (``dhp.checkpoint.carried``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeThinkerConfig,
)

from dhp.config.issues import Issues
from dhp.errors import CheckpointError, ConfigError, DataError
from dhp.models.axes import runtime_plan
from dhp.models.checks import image_token_counts
from dhp.models.common import blank_image, lm_head
from dhp.models.dtypes import torch_dtype
from dhp.models.family import HandOff, ProducerShard
from dhp.models.qwen3_base.base_family import Qwen3Family, _plain, transposed_experts
from dhp.models.qwen3_omni.arch import ARCH, AUDIO_EMBEDS, MERGERS, audio_axes
from dhp.models.qwen3_omni.audio import (
    audio_token_counts,
    check_audio_geometry,
    shard_audio,
)
from dhp.models.qwen3_vision.config import vision_config_kwargs
from dhp.models.qwen3_vision.sp import shard_images
from dhp.models.qwen3_vision.tp import vision_parallel_plan
from dhp.ops.packed import VIDEO, interleaved_videos
from dhp.parallel.module_plan import ModuleParallelPlan

#: ``SpecialTokens`` field -> the token's text in Qwen3-Omni's tokenizer
OMNI_TOKEN_STRINGS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "audio_token_id": "<|audio_pad|>",
    "audio_start_token_id": "<|audio_start|>",
    "audio_end_token_id": "<|audio_end|>",
}
#: token ids the thinker config carries beside ``image_token_id`` / ``video_token_id``
_THINKER_TOKENS = (
    "audio_token_id",
    "audio_start_token_id",
    "audio_end_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)


class Qwen3OmniFamily(Qwen3Family):
    """Qwen3-Omni's thinker: ``audio`` feeds ``audio_embeds``, ``vision`` (ViT + merger + DeepStack
    mergers) feeds ``image_embeds`` and ``deepstack_embeds_k`` to ``llm`` (the Qwen3 MoE decoder)."""

    name = "qwen3_omni"
    arch = ARCH
    module_names = ("audio", "vision", "llm")
    configs: ClassVar[Mapping[str, tuple[type, str]]] = {
        "qwen3_omni_moe_thinker": (Qwen3OmniMoeThinkerConfig, "Qwen3OmniMoeThinkerForConditionalGeneration"),
        "qwen3_omni_moe": (Qwen3OmniMoeConfig, "Qwen3OmniMoeForConditionalGeneration"),
    }
    #: first match wins: transformers 5's thinker, a full model (transformers 5's, then the released one)
    checkpoint_keys = (
        ("model.audio_tower.", "audio", "audio_tower."),
        ("model.visual.", "vision", "visual."),
        ("model.language_model.", "llm", "language_model."),
        ("lm_head.", "llm", "lm_head."),
        ("thinker.model.audio_tower.", "audio", "audio_tower."),
        ("thinker.model.visual.", "vision", "visual."),
        ("thinker.model.language_model.", "llm", "language_model."),
        ("thinker.audio_tower.", "audio", "audio_tower."),
        ("thinker.visual.", "vision", "visual."),
        ("thinker.model.", "llm", "language_model."),
        ("thinker.lm_head.", "llm", "lm_head."),
        # the speech output of a full model: modules outside this graph (never built or read)
        ("talker.", "talker", "talker."),
        ("code2wav.", "code2wav", "code2wav."),
    )

    # --- flavours: the thinker is always the MoE one ----------------------------------------------
    def is_moe(self, hf_config: PretrainedConfig) -> bool:
        return True

    def _levels(self, hf_config: PretrainedConfig) -> int:
        return len(hf_config.vision_config.deepstack_visual_indexes)

    # --- graph and producer inputs (driver side, pure) -----------------------------------------
    def handoffs_for(self, hf_config: Qwen3OmniMoeThinkerConfig) -> tuple[HandOff, ...]:
        """``audio_embeds`` (audio -> llm, ``audio_tokens``), then the vision edges (``image_tokens``)."""
        width = hf_config.text_config.hidden_size
        audio = HandOff("audio", "llm", AUDIO_EMBEDS, "audio_tokens", width=width, grad=True)
        return (audio, *super().handoffs_for(hf_config))

    def shard_inputs(
        self,
        name: str,
        hf_config: Qwen3OmniMoeThinkerConfig,
        *,
        sp_size: int,
        rows: torch.Tensor | None = None,
        meta: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> list[ProducerShard]:
        """The SP cut of producer ``name``'s items: audio (mel frames, frames per audio): whole attention
        windows per rank, no collective (``audio.shard_audio``); vision (patches, grids; also as
        ``pixel_values``/``image_grid_thw``): contiguous merge units, Ulysses in the attention."""
        rows = pixel_values if rows is None else rows
        meta = image_grid_thw if meta is None else meta
        if name == "audio":
            a = hf_config.audio_config
            return shard_audio(
                rows, meta, sp_size=sp_size, n_window=a.n_window, n_window_infer=a.n_window_infer
            )
        return shard_images(rows, meta, sp_size=sp_size, config=hf_config.vision_config)

    def shard_items(
        self,
        name: str,
        hf_config: Qwen3OmniMoeThinkerConfig,
        *,
        rows: torch.Tensor,
        meta: torch.Tensor,
        sp_size: int,
    ) -> list[ProducerShard]:
        """Producer ``name``'s SP cut of one replica's items (:meth:`shard_inputs`)."""
        return self.shard_inputs(name, hf_config, rows=rows, meta=meta, sp_size=sp_size)

    def tokens_per_item(
        self, name: str, hf_config: Qwen3OmniMoeThinkerConfig, meta: torch.Tensor
    ) -> list[int]:
        """Hand-off rows per item: an audio's rows of its frames (13 per 100); an image's or video's
        ``t*h*w / merge**2``."""
        if name == "audio":
            return audio_token_counts(meta, n_window=hf_config.audio_config.n_window)
        return image_token_counts(meta, hf_config.vision_config.spatial_merge_size)

    def blank_input(
        self, name: str, hf_config: Qwen3OmniMoeThinkerConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest valid input of producer ``name``: one zero mel frame (one audio row) with meta
        ``[[1]]``, or one merge unit of zero patches with grid ``[[1, m, m]]``."""
        if name == "audio":
            return torch.zeros(1, hf_config.audio_config.num_mel_bins), torch.tensor([[1]])
        return blank_image(hf_config.vision_config)

    # --- data glue -------------------------------------------------------------------------------
    def token_strings(self) -> dict[str, str]:
        """The special tokens' text in Qwen3-Omni's tokenizer (``<|image_pad|>``, ``<|audio_pad|>``, ...)."""
        return dict(OMNI_TOKEN_STRINGS)

    def video_with_audio_ids(
        self,
        hf_config: Qwen3OmniMoeThinkerConfig,
        *,
        grid: tuple[int, int, int],
        seconds: float,
        audio_tokens: int,
    ) -> list[int]:
        """The token ids a video interleaved with its audio track takes between its vision-start and
        vision-end tokens, as ``Qwen3OmniMoeProcessor`` writes them: audio-start, then each temporal
        grid's video tokens placed at its start time (``t * seconds * position_id_per_seconds``) among
        the audio tokens (one position each; a tie puts the video first), audio-end. ``grid``: the
        video's ``(t, h, w)`` patches; ``seconds``: seconds per temporal grid."""
        t, h, w = grid
        merge = hf_config.vision_config.spatial_merge_size
        per_grid = (h // merge) * (w // merge)
        times = [k * seconds * hf_config.position_id_per_seconds for k in range(t) for _ in range(per_grid)]
        ids, v, a = [], 0, 0
        while v < len(times) and a < audio_tokens:
            if times[v] <= a:
                ids.append(hf_config.video_token_id)
                v += 1
            else:
                ids.append(hf_config.audio_token_id)
                a += 1
        ids += [hf_config.video_token_id] * (len(times) - v) + [hf_config.audio_token_id] * (audio_tokens - a)
        return [hf_config.audio_start_token_id, *ids, hf_config.audio_end_token_id]

    def load_audio_processor(self, model_path: str) -> Any:
        """transformers' ``WhisperFeatureExtractor`` of ``model_path``'s ``preprocessor_config.json``
        (16 kHz mono -> ``feature_size`` mel bins, hop 160: 100 frames per second)."""
        # reason: transformers' audio code loads only in a process that reads audio records
        from transformers import WhisperFeatureExtractor

        return WhisperFeatureExtractor.from_pretrained(model_path)

    def reference_kwargs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The whole batch's inputs as ``Qwen3OmniMoeThinkerForConditionalGeneration.forward`` names them:
        ``video_second_per_grid`` for ``second_per_grid_ts``, no ``mm_token_type_ids`` (the thinker finds
        its placeholders by id), and its one ``use_audio_in_video`` per call, read from the tokens (a
        video token next to an audio token: a video interleaved with its audio track). DataError when
        the batch mixes videos with and without their audio (transformers takes one flag per call)."""
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

    # --- parallel plans -------------------------------------------------------------------------
    def parallel_plan(self, name: str, hf_config: PretrainedConfig) -> ModuleParallelPlan:
        """Audio: FSDP by block, no TP, SP over whole attention windows (no collective). Vision: the
        shared Qwen3 encoder plan over transformers' ``merger_list``. LLM: the Qwen3 MoE decoder's."""
        if name == "audio":
            return runtime_plan(audio_axes(), blocks=("audio_tower.layers.*",))
        if name == "vision":
            axes = self.arch.axes_of(name, self.numbers(hf_config))
            return vision_parallel_plan(axes, deepstack=True, mergers=MERGERS)
        return super().parallel_plan(name, hf_config)

    # --- configs -------------------------------------------------------------------------------
    def hf_config(self, model_cfg: Any) -> Qwen3OmniMoeThinkerConfig:
        """The thinker's transformers config from the schema's numbers (ConfigError if invalid)."""
        model = _plain(model_cfg)
        issues = Issues()
        self.arch.validate(model, issues)
        if issues.items:
            raise ConfigError(issues.items)
        n = self.arch.numbers(model)
        a, tok = model.audio, model.tokens
        audio = dict(
            num_mel_bins=a.num_mel_bins,
            encoder_layers=a.depth,
            encoder_attention_heads=a.num_heads,
            encoder_ffn_dim=a.intermediate_size,
            d_model=a.hidden_size,
            max_source_positions=a.max_source_positions,
            n_window=a.n_window,
            n_window_infer=a.extra["n_window_infer"],
            conv_chunksize=a.extra["conv_chunksize"],
            downsample_hidden_size=a.extra["downsample_hidden_size"],
            output_dim=n.hidden,
        )
        text = self.text_config(n) | dict(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
        cfg = Qwen3OmniMoeThinkerConfig(
            architectures=[self.configs["qwen3_omni_moe_thinker"][1]],
            audio_config=audio,
            vision_config=vision_config_kwargs(n.vision, deepstack=True),
            text_config=text,
            image_token_id=tok.image_token_id,
            video_token_id=tok.video_token_id,
            position_id_per_seconds=model.llm.extra["position_id_per_seconds"],
            tie_word_embeddings=n.tied,
            attn_implementation=model.attn_implementation,
            dtype=torch_dtype(model.dtype),
        )
        for key in _THINKER_TOKENS:  # read by get_rope_index, not declared fields of the class
            setattr(cfg, key, getattr(tok, key))
        return cfg

    def read_hf_config(self, model_type: str, path: Path, raw: Mapping[str, Any]) -> PretrainedConfig:
        """``qwen3_omni_moe_thinker``: the thinker's config; ``qwen3_omni_moe``: the full model's
        ``thinker_config`` (the talker's and code2wav's are not read)."""
        if model_type == "qwen3_omni_moe":
            cfg = Qwen3OmniMoeConfig.from_pretrained(str(path)).thinker_config
        else:
            cfg = Qwen3OmniMoeThinkerConfig.from_pretrained(str(path))
        missing = [
            k for k in ("vision_start_token_id", "audio_end_token_id") if getattr(cfg, k, None) is None
        ]
        if missing:
            raise CheckpointError(
                f"{path}/config.json: the thinker config has no {missing}, which TMRoPE and the audio "
                "placement read. Fix: add the tokenizer's ids (<|vision_start|> 151652, <|audio_end|> "
                "151648 in the released checkpoints) to the thinker config."
            )
        a = cfg.audio_config
        check_audio_geometry(n_window=a.n_window, n_window_infer=a.n_window_infer, where="audio_config")
        return cfg

    def tiny_hf_config(self, *, moe: bool = True, tie_word_embeddings: bool = False) -> PretrainedConfig:
        """``hf_config`` of ``conf/model/tiny_qwen3_omni.yaml`` (always MoE)."""
        model_cfg = self.tiny_model_config()
        model_cfg.llm.tie_word_embeddings = tie_word_embeddings
        return self.hf_config(model_cfg)

    # --- modules -------------------------------------------------------------------------------
    def new_module(
        self, name: str, hf_config: PretrainedConfig, *, device: torch.device | str, dtype: torch.dtype
    ) -> nn.Module:
        """transformers' audio encoder, vision encoder (the shared Qwen3 wrapper) or MoE decoder
        (+ ``lm_head``) in this family's wrappers."""
        # reason: transformers' model code costs seconds to import; the driver builds no module
        from dhp.models.qwen3_omni.modules import CLASSES, AudioModule, LLMModule, VisionModule

        if name == "audio":
            return AudioModule(CLASSES.audio._from_config(hf_config.audio_config, dtype=dtype))
        if name == "vision":
            visual = CLASSES.vision._from_config(hf_config.vision_config, dtype=dtype)
            return VisionModule(visual, num_deepstack=self._levels(hf_config))
        text = hf_config.text_config
        return LLMModule(
            CLASSES.text._from_config(text, dtype=dtype),
            lm_head(text, device=device, dtype=dtype),
            hf_config,
            rope_model=CLASSES.rope_model,
            moe=True,
            num_deepstack=self._levels(hf_config),
            family=self.name,
        )

    def init_buffers(self, name: str, module: nn.Module) -> None:
        """The rotary buffers (vision, LLM) as the base does; the audio encoder's sinusoidal position
        table (a non-persistent buffer) recomputed as transformers' init does."""
        if name != "audio":
            super().init_buffers(name, module)
            return
        table = module.audio_tower.positional_embedding
        with torch.no_grad():
            table.positional_embedding.copy_(table.compute_default_singular_positional_embedding())

    def reference_class(self, hf_config: PretrainedConfig) -> type[nn.Module]:
        """``Qwen3OmniMoeThinkerForConditionalGeneration``."""
        # reason: transformers' model code costs ~2.3 CPU-s to import; only what builds a module loads it
        from dhp.models.qwen3_omni.modules import CLASSES

        return CLASSES.reference

    def stored_dims(
        self, fqn: str, stored_shape: tuple[int, ...], shape: tuple[int, ...]
    ) -> tuple[int, ...] | None:
        """Fused experts stored transposed ([E, H, 2I] / [E, I, H]): transposed on load."""
        return transposed_experts(fqn, stored_shape, shape)


FAMILY = Qwen3OmniFamily
