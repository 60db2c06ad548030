"""Qwen2.5-VL as a :class:`~dhp.models.family.ModelFamily`: modules ``vision`` -> ``llm``.

Checkpoint layout (transformers >= 4.52 / 5.x): ``model.visual.*``, ``model.language_model.*``,
``lm_head.*``. The hub's older layout (``visual.*``, ``model.*``) is accepted too.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    PretrainedConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLTextConfig,
)

from dhp.config.schema import ModelConfig
from dhp.models.common import decoder_config, lm_head, vl_config
from dhp.models.dtypes import DTYPES, torch_dtype  # noqa: F401  (re-exported)
from dhp.models.family import HandOff, ModuleParallelPlan
from dhp.models.family_base import VL_CHECKPOINT_KEYS, FamilyBase
from dhp.models.qwen2_5_vision.sp import VisionShard, shard_vision_batch
from dhp.models.qwen2_5_vl.export_processor import make_processor_loadable
from dhp.models.qwen2_5_vl.parallel import parallel_plan


def _text_only_config(raw: dict) -> Qwen2_5_VLTextConfig:
    """A text-only LLM (``qwen2`` or ``qwen2_5_vl_text`` config.json) as the Qwen2.5-VL text config.

    Text positions are the same in M-RoPE's 3 rows, so any section split is plain 1D RoPE; a
    ``qwen2`` config has none, so all rotary pairs go to the first row: ``[head_dim // 2, 0, 0]``.
    """
    cfg = Qwen2_5_VLTextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    if "mrope_section" not in cfg.rope_parameters:
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        cfg.rope_parameters["mrope_section"] = [head_dim // 2, 0, 0]
    return cfg


class Qwen25VLFamily(FamilyBase):
    """Qwen2.5-VL: ``vision`` (ViT + merger) feeds ``image_embeds`` to ``llm`` (decoder + lm_head)."""

    name = "qwen2_5_vl"
    #: a Qwen2.5-VL checkpoint, or a text-only LLM
    model_types = ("qwen2_5_vl", "qwen2_5_vl_text", "qwen2")
    tiny_entry = "tiny"
    #: transformers 5's layout, then the hub's older one (``visual.*``, ``model.layers.*``)
    checkpoint_keys = (
        *VL_CHECKPOINT_KEYS,
        ("visual.", "vision", "visual."),
        ("model.", "llm", "language_model."),
    )

    def handoffs_for(self, hf_config: Qwen2_5_VLConfig | Qwen2_5_VLTextConfig) -> tuple[HandOff, ...]:
        """One edge: the merger's output rows, placed at the ``<|image_pad|>`` positions (none text-only)."""
        if not isinstance(hf_config, Qwen2_5_VLConfig):
            return ()
        width = hf_config.vision_config.out_hidden_size
        return (HandOff("vision", "llm", "image_embeds", "image_tokens", width=width, grad=True),)

    # --- producer inputs (driver side, pure) ---------------------------------------------------
    def shard_inputs(
        self,
        name: str,
        hf_config: Qwen2_5_VLConfig,
        *,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor,
        sp_size: int,
    ) -> list[VisionShard]:
        """Window-aligned SP cut of one micro-batch's patches (``dhp.models.qwen2_5_vision.sp``)."""
        return shard_vision_batch(pixel_values, image_grid_thw, sp_size=sp_size, arch=hf_config.vision_config)

    # --- parallel plans -------------------------------------------------------------------------
    def parallel_plan(
        self, name: str, hf_config: Qwen2_5_VLConfig | Qwen2_5_VLTextConfig
    ) -> ModuleParallelPlan:
        """Encoder: TP by FQN (fused qkv), Ulysses SP on the full-attention blocks only (window blocks
        stay local). LLM: the decoder TP plan (with sequence parallelism inside TP) and the loss."""
        return parallel_plan(name, hf_config, tied=self.tied_parameters(name, hf_config))

    def finish_export(self, out_dir: Path) -> None:
        """Where torchvision does not import, name a processor class without the video part
        (:mod:`dhp.models.qwen2_5_vl.export_processor`), so ``AutoProcessor`` loads the export."""
        make_processor_loadable(out_dir)

    # --- configs -------------------------------------------------------------------------------
    def hf_config(self, model_cfg: ModelConfig) -> Qwen2_5_VLConfig:
        """Build the transformers config from the schema's numbers (no file is read)."""
        v, t = model_cfg.vision, model_cfg.llm
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
        ) | dict(intermediate_size=t.intermediate_size)
        return vl_config(
            Qwen2_5_VLConfig,
            architecture="Qwen2_5_VLForConditionalGeneration",
            vision=vision,
            text=text,
            tokens=model_cfg.tokens,
            tied=t.tie_word_embeddings,
            attn_implementation=model_cfg.attn_implementation,
            dtype=torch_dtype(model_cfg.dtype),
        )

    def read_hf_config(self, model_type: str, path: Path, raw: Mapping[str, Any]) -> PretrainedConfig:
        """``qwen2_5_vl``: the VLM's config; ``qwen2_5_vl_text`` / ``qwen2``: a text-only LLM's."""
        if model_type == "qwen2_5_vl":
            return Qwen2_5_VLConfig.from_pretrained(str(path))
        return _text_only_config(dict(raw))

    # --- modules -------------------------------------------------------------------------------
    def modules_for(self, hf_config: Qwen2_5_VLConfig | Qwen2_5_VLTextConfig) -> tuple[str, ...]:
        """The modules this config has: both, or only ``llm`` for a text-only config."""
        return self.module_names if isinstance(hf_config, Qwen2_5_VLConfig) else ("llm",)

    def new_module(
        self,
        name: str,
        hf_config: Qwen2_5_VLConfig | Qwen2_5_VLTextConfig,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> nn.Module:
        """transformers' encoder or decoder (+ ``lm_head``) in this family's module wrapper."""
        # reason: transformers' model code costs ~2.3 CPU-s to import; the driver reads this family's
        # names, configs and hand-offs but builds nothing, so only what builds a module loads it
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
            Qwen2_5_VLTextModel,
        )

        from dhp.models.qwen2_5_vl.modules import LLMModule, VisionModule

        if name == "vision":
            return VisionModule(
                Qwen2_5_VisionTransformerPretrainedModel._from_config(hf_config.vision_config, dtype=dtype)
            )
        text_cfg = hf_config.text_config if isinstance(hf_config, Qwen2_5_VLConfig) else hf_config
        language_model = Qwen2_5_VLTextModel._from_config(text_cfg, dtype=dtype)
        return LLMModule(language_model, lm_head(text_cfg, device=device, dtype=dtype), hf_config)

    def reference_class(self, hf_config: Qwen2_5_VLConfig) -> type[nn.Module]:
        """``Qwen2_5_VLForConditionalGeneration``."""
        # reason: transformers' model code costs ~2.3 CPU-s to import; the driver reads this family's
        # names, configs and hand-offs but builds nothing, so only what builds a module loads it
        from transformers import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration


FAMILY = Qwen25VLFamily
