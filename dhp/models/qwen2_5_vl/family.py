"""Qwen2.5-VL as a :class:`~dhp.models.family.ModelFamily`: modules ``vision`` -> ``llm``.

Checkpoint layout (transformers >= 4.52 / 5.x): ``model.visual.*``, ``model.language_model.*``,
``lm_head.*``. The hub's older layout (``visual.*``, ``model.*``) is accepted too.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLTextConfig,
)

from dhp.config.schema import ModelConfig
from dhp.errors import CheckpointError, ConfigError, ConfigIssue
from dhp.models.common import (
    TIED_LM_HEAD,
    KeyMap,
    init_rotary_buffers,
    lm_head,
    reference_model,
    tie_lm_head,
)
from dhp.models.dtypes import DTYPES, torch_dtype  # noqa: F401  (re-exported)
from dhp.models.entries import model_entry
from dhp.models.family import HandOff, ModuleParallelPlan
from dhp.models.qwen2_5_vl.export_processor import make_processor_loadable
from dhp.models.qwen2_5_vl.parallel import parallel_plan
from dhp.models.qwen2_5_vl.sp_shard import VisionShard, shard_vision_batch
from dhp.models.tokens import TOKEN_STRINGS

if TYPE_CHECKING:
    from transformers import Qwen2_5_VLForConditionalGeneration

#: checkpoint prefix -> (module, module FQN prefix); the hub's older layout (``visual.*``, ``model.*``) too
KEYS = KeyMap(
    family="qwen2_5_vl",
    owners=(
        ("model.visual.", "vision", "visual."),
        ("visual.", "vision", "visual."),
        ("model.language_model.", "llm", "language_model."),
        ("lm_head.", "llm", "lm_head."),
        ("model.", "llm", "language_model."),  # hub's older layout: model.layers.*
    ),
)


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


class Qwen25VLFamily:
    """Qwen2.5-VL: ``vision`` (ViT + merger) feeds ``image_embeds`` to ``llm`` (decoder + lm_head)."""

    name = "qwen2_5_vl"
    module_names = ("vision", "llm")

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
        """Window-aligned SP cut of one micro-batch's patches (``sp_shard.shard_vision_batch``)."""
        return shard_vision_batch(pixel_values, image_grid_thw, sp_size=sp_size, arch=hf_config.vision_config)

    def tokens_per_image(self, hf_config: Qwen2_5_VLConfig, image_grid_thw: torch.Tensor) -> list[int]:
        """``t*h*w / spatial_merge_size**2`` merged tokens per image."""
        merge = hf_config.vision_config.spatial_merge_size**2
        return [int(g.prod()) // merge for g in image_grid_thw]

    def blank_image(self, hf_config: Qwen2_5_VLConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """One merge unit of zero patches: ``(m*m, C*T*P*P)`` and grid ``[[1, m, m]]``."""
        v = hf_config.vision_config
        m = v.spatial_merge_size
        return torch.zeros(m * m, v.in_channels * v.temporal_patch_size * v.patch_size**2), torch.tensor(
            [[1, m, m]]
        )

    # --- parallel plans -------------------------------------------------------------------------
    def parallel_plan(
        self, name: str, hf_config: Qwen2_5_VLConfig | Qwen2_5_VLTextConfig
    ) -> ModuleParallelPlan:
        """Encoder: TP by FQN (fused qkv), Ulysses SP on the full-attention blocks only (window blocks
        stay local). LLM: the decoder TP plan (with sequence parallelism inside TP) and the loss."""
        return parallel_plan(name, hf_config, tied=self.tied_parameters(name, hf_config))

    # --- data glue -----------------------------------------------------------------------------
    def token_strings(self) -> dict[str, str]:
        """The tokenizer's text of the special tokens the graph relies on."""
        return dict(TOKEN_STRINGS)

    def finish_export(self, out_dir: Path) -> None:
        """Where torchvision does not import, name a processor class without the video part
        (:mod:`dhp.models.qwen2_5_vl.export_processor`), so ``AutoProcessor`` loads the export."""
        make_processor_loadable(out_dir)

    def load_image_processor(self, model_path: str, *, min_pixels: int, max_pixels: int) -> Any:
        """transformers' Qwen2-VL PIL image processor from ``preprocessor_config.json`` (no torchvision)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil.from_pretrained(
            model_path, min_pixels=min_pixels, max_pixels=max_pixels
        )

    # --- configs -------------------------------------------------------------------------------
    def hf_config(self, model_cfg: ModelConfig) -> Qwen2_5_VLConfig:
        """Build the transformers config from the schema's numbers (no file is read)."""
        v, t, tok = model_cfg.vision, model_cfg.llm, model_cfg.tokens
        return Qwen2_5_VLConfig(
            architectures=["Qwen2_5_VLForConditionalGeneration"],  # config.json names the class that loads it
            vision_config=dict(
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
            ),
            text_config=dict(
                vocab_size=t.vocab_size,
                hidden_size=t.hidden_size,
                num_hidden_layers=t.num_layers,
                num_attention_heads=t.num_heads,
                num_key_value_heads=t.num_kv_heads,
                intermediate_size=t.intermediate_size,
                rms_norm_eps=t.rms_norm_eps,
                max_position_embeddings=t.max_position_embeddings,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": t.rope_theta,
                    "mrope_section": list(t.extra["mrope_section"]),
                },
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            ),
            image_token_id=tok.image_token_id,
            video_token_id=tok.video_token_id,
            vision_start_token_id=tok.vision_start_token_id,
            vision_end_token_id=tok.vision_end_token_id,
            tie_word_embeddings=t.tie_word_embeddings,
            attn_implementation=model_cfg.attn_implementation,
            dtype=torch_dtype(model_cfg.dtype),
        )

    def hf_config_from_dir(
        self, path: str | Path, *, attn_implementation: str = "sdpa"
    ) -> Qwen2_5_VLConfig | Qwen2_5_VLTextConfig:
        """Read ``config.json`` of a local HF directory: a Qwen2.5-VL config, or a text-only one."""
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{cfg_file} not found. Fix: point model.path at a HF model directory.")
        raw = json.loads(cfg_file.read_text())
        kind = raw.get("model_type")  # file content, not our config: absent is an error below
        if kind == "qwen2_5_vl":
            cfg = Qwen2_5_VLConfig.from_pretrained(str(path))
        elif kind in ("qwen2_5_vl_text", "qwen2"):
            cfg = _text_only_config(raw)
        else:
            raise CheckpointError(
                f"{cfg_file}: model_type {kind!r} is not a {self.name} model (expected 'qwen2_5_vl', or "
                f"'qwen2_5_vl_text'/'qwen2' for a text-only LLM). Fix: set model.family to match the checkpoint."
            )
        cfg._attn_implementation = attn_implementation
        return cfg

    def tiny_model_config(self) -> ModelConfig:
        """The tiny test architecture: ``conf/model/tiny.yaml`` (fp32), where its numbers are written."""
        return model_entry("tiny")

    # --- modules -------------------------------------------------------------------------------
    def modules_for(self, hf_config: Qwen2_5_VLConfig | Qwen2_5_VLTextConfig) -> tuple[str, ...]:
        """The modules this config has: both, or only ``llm`` for a text-only config."""
        return self.module_names if isinstance(hf_config, Qwen2_5_VLConfig) else ("llm",)

    def build_module(
        self,
        name: str,
        hf_config: Qwen2_5_VLConfig | Qwen2_5_VLTextConfig,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> nn.Module:
        """Build ``vision`` or ``llm`` alone on ``device``; on ``meta`` no memory is allocated.

        On a real device the weights get transformers' random init (directly on that device).
        The other module is never built. ``hf_config`` is not mutated.
        """
        # reason: transformers' model code costs ~2.3 CPU-s to import; the driver reads this family's
        # names, configs and hand-offs but builds nothing, so only what builds a module loads it
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
            Qwen2_5_VLTextModel,
        )

        from dhp.models.qwen2_5_vl.modules import LLMModule, VisionModule

        if name not in self.modules_for(hf_config):
            raise ConfigError(
                [
                    ConfigIssue(
                        path="modules",
                        value=name,
                        rule=f"{self.name} config has modules {self.modules_for(hf_config)}"
                        + (
                            ""
                            if isinstance(hf_config, Qwen2_5_VLConfig)
                            else " (text-only: no vision_config)"
                        ),
                        fix="remove this module from modules, or use a vision-language checkpoint",
                    )
                ]
            )
        cfg = copy.deepcopy(hf_config)
        with torch.device(device):
            if name == "vision":
                module = VisionModule(
                    Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg.vision_config, dtype=dtype)
                )
                module.parallel_plan = self.parallel_plan(name, cfg)  # what dhp.parallel shards, by FQN
                return module
            text_cfg = cfg.text_config if isinstance(cfg, Qwen2_5_VLConfig) else cfg
            language_model = Qwen2_5_VLTextModel._from_config(text_cfg, dtype=dtype)
            module = LLMModule(language_model, lm_head(text_cfg, device=device, dtype=dtype), cfg)
            self.tie(name, module, cfg)
            module.parallel_plan = self.parallel_plan(name, cfg)  # what dhp.parallel shards, by FQN
            return module

    def tied_parameters(
        self, name: str, hf_config: Qwen2_5_VLConfig | Qwen2_5_VLTextConfig
    ) -> dict[str, str]:
        """``{"lm_head.weight": "language_model.embed_tokens.weight"}`` when embeddings are tied."""
        # a transformers config attribute (absent on a bare text config means "not tied")
        if name == "llm" and getattr(hf_config, "tie_word_embeddings", False):
            return dict(TIED_LM_HEAD)
        return {}

    def tie(self, name: str, module: nn.Module, hf_config: Qwen2_5_VLConfig | Qwen2_5_VLTextConfig) -> None:
        """Make tied parameters share storage again (after building or ``to_empty``)."""
        if self.tied_parameters(name, hf_config):
            tie_lm_head(module)

    def init_buffers(self, name: str, module: nn.Module) -> None:
        """Recompute the rotary ``inv_freq`` buffers after ``to_empty`` (``common.init_rotary_buffers``)."""
        init_rotary_buffers(self.name, name, module)

    # --- checkpoint keys -----------------------------------------------------------------------
    def checkpoint_owner(self, key: str) -> tuple[str, str] | None:
        """Checkpoint key -> ``(module_name, module_fqn)``; None if no module owns it."""
        return KEYS.owner(key)

    def split_state_dict(self, ref_state_dict: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """Reference (or checkpoint) state dict -> ``{"vision": {...}, "llm": {...}}`` keyed by module FQN."""
        return KEYS.split(ref_state_dict, self.module_names)

    def reference_model(self, hf_config: Qwen2_5_VLConfig) -> Qwen2_5_VLForConditionalGeneration:
        """The untouched transformers model, randomly initialised on CPU in the config's dtype."""
        # reason: transformers' model code costs ~2.3 CPU-s to import; the driver reads this family's
        # names, configs and hand-offs but builds nothing, so only what builds a module loads it
        from transformers import Qwen2_5_VLForConditionalGeneration

        return reference_model(Qwen2_5_VLForConditionalGeneration, hf_config)


FAMILY = Qwen25VLFamily
