"""Qwen3-VL as a :class:`~dhp.models.family.ModelFamily`: ``vision`` -> 1 + K edges -> ``llm``.

Edges: ``image_embeds`` (placed at the image tokens of the input embeddings) and one edge per DeepStack
level, ``deepstack_embeds_k`` (added to the hidden states at the image tokens after decoder layer k).
All are layout ``image_tokens`` (one row per merged image token, micro-batch order), width = the LLM
hidden size, and carry a gradient back to the encoder.

Checkpoint layout (transformers >= 4.57 / 5.x, as released): ``model.visual.*``,
``model.language_model.*``, ``lm_head.*``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from transformers import Qwen3VLConfig

from dhp.config.issues import Issues
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
from dhp.models.dtypes import torch_dtype
from dhp.models.entries import model_entry
from dhp.models.family import HandOff, ModuleParallelPlan
from dhp.models.qwen3_vision.arch import IMAGE_EMBEDS, deepstack_kwarg
from dhp.models.qwen3_vision.sp import Qwen3VisionShard, blank_image, shard_images, tokens_per_image
from dhp.models.qwen3_vision.tp import vision_parallel_plan
from dhp.models.qwen3_vl.arch import numbers, validate
from dhp.models.qwen3_vl.config import build_hf_config
from dhp.models.qwen3_vl.tp import llm_plan
from dhp.models.tokens import TOKEN_STRINGS

if TYPE_CHECKING:
    from transformers import Qwen3VLForConditionalGeneration

IMAGE_TOKENS = "image_tokens"

#: checkpoint prefix -> (module, module FQN prefix)
KEYS = KeyMap(
    family="qwen3_vl",
    owners=(
        ("model.visual.", "vision", "visual."),
        ("model.language_model.", "llm", "language_model."),
        ("lm_head.", "llm", "lm_head."),
    ),
)


def _plain(model_cfg: Any) -> Any:
    """A ModelConfig dataclass as a DictConfig (the arch functions read attributes and ``extra`` maps)."""
    return OmegaConf.structured(model_cfg) if dataclasses.is_dataclass(model_cfg) else model_cfg


class Qwen3VLFamily:
    """Qwen3-VL: ``vision`` (ViT + merger + DeepStack mergers) feeds 1 + K tensors to ``llm``."""

    name = "qwen3_vl"
    module_names = ("vision", "llm")

    # --- graph ---------------------------------------------------------------------------------
    def handoffs_for(self, hf_config: Qwen3VLConfig) -> tuple[HandOff, ...]:
        """``image_embeds`` then ``deepstack_embeds_0 .. K-1``: vision -> llm, ``image_tokens``, LLM width."""
        width = hf_config.vision_config.out_hidden_size
        levels = len(hf_config.vision_config.deepstack_visual_indexes)
        kwargs = (IMAGE_EMBEDS, *(deepstack_kwarg(k) for k in range(levels)))
        return tuple(
            HandOff("vision", "llm", kwarg, IMAGE_TOKENS, width=width, grad=True) for kwarg in kwargs
        )

    # --- producer inputs (driver side, pure) ---------------------------------------------------
    def shard_inputs(
        self,
        name: str,
        hf_config: Qwen3VLConfig,
        *,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor,
        sp_size: int,
    ) -> list[Qwen3VisionShard]:
        """Contiguous, merge-unit-aligned SP cut of one micro-batch's patches (``sp.shard_images``)."""
        return shard_images(pixel_values, image_grid_thw, sp_size=sp_size, config=hf_config.vision_config)

    def tokens_per_image(self, hf_config: Qwen3VLConfig, image_grid_thw: torch.Tensor) -> list[int]:
        """``t*h*w / spatial_merge_size**2`` merged tokens per image."""
        return tokens_per_image(hf_config.vision_config, image_grid_thw)

    def blank_image(self, hf_config: Qwen3VLConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """One merge unit of zero patches: ``(m*m, C*T*P*P)`` and grid ``[[1, m, m]]``."""
        return blank_image(hf_config.vision_config)

    # --- parallel plans ------------------------------------------------------------------------
    def parallel_plan(self, name: str, hf_config: Qwen3VLConfig) -> ModuleParallelPlan:
        """Encoder: TP by FQN incl. the DeepStack mergers, Ulysses SP on every block's attention.
        LLM: the decoder TP plan without sequence parallelism (DeepStack, see ``tp.py``) and the loss."""
        if name == "vision":
            return vision_parallel_plan(hf_config.vision_config, deepstack=True)
        t = hf_config.text_config
        return ModuleParallelPlan(
            blocks=("language_model.layers.*",),
            tp=llm_plan,
            tp_divides={
                "num_attention_heads": t.num_attention_heads,
                "num_key_value_heads": t.num_key_value_heads,
                "vocab_size": t.vocab_size,
                "intermediate_size": t.intermediate_size,
            },
            tp_sequence_parallel=False,
            loss=True,
            tied=self.tied_parameters(name, hf_config),
            pad_token_id=t.pad_token_id if t.pad_token_id is not None else 0,
        )

    # --- data glue -----------------------------------------------------------------------------
    def token_strings(self) -> dict[str, str]:
        """The tokenizer's text of the special tokens the graph relies on (Qwen3-VL keeps Qwen's)."""
        return dict(TOKEN_STRINGS)

    def finish_export(self, out_dir: Path) -> None:
        """Nothing to add: the export keeps the checkpoint's own processor files."""

    def load_image_processor(self, model_path: str, *, min_pixels: int, max_pixels: int) -> Any:
        """transformers' Qwen2-VL PIL image processor (Qwen3-VL ships the same class with patch 16)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil.from_pretrained(
            model_path, min_pixels=min_pixels, max_pixels=max_pixels
        )

    # --- configs -------------------------------------------------------------------------------
    def hf_config(self, model_cfg: Any) -> Qwen3VLConfig:
        """The transformers config from the schema's numbers and ``extra`` maps (ConfigError if invalid)."""
        model = _plain(model_cfg)
        issues = Issues()
        validate(model, issues)
        if issues.items:
            raise ConfigError(issues.items)
        tokens = (
            OmegaConf.to_container(model.tokens) if isinstance(model.tokens, DictConfig) else model.tokens
        )
        return build_hf_config(
            numbers(model),
            tokens=dict(tokens),
            dtype=torch_dtype(model.dtype),
            attn_implementation=model.attn_implementation,
        )

    def tiny_model_config(self) -> ModelConfig:
        """The tiny test architecture: ``conf/model/tiny_qwen3_vl.yaml`` (fp32), where its numbers are written."""
        return model_entry("tiny_qwen3_vl")

    def tiny_hf_config(self, *, tie_word_embeddings: bool = False) -> Qwen3VLConfig:
        """``hf_config(tiny_model_config())``, optionally with tied embeddings."""
        model_cfg = self.tiny_model_config()
        model_cfg.llm.tie_word_embeddings = tie_word_embeddings
        return self.hf_config(model_cfg)

    def hf_config_from_dir(self, path: str | Path, *, attn_implementation: str = "sdpa") -> Qwen3VLConfig:
        """Read ``config.json`` of a local HF directory; it must be a ``qwen3_vl`` model."""
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{cfg_file} not found. Fix: point model.path at a HF model directory.")
        kind = json.loads(cfg_file.read_text()).get("model_type")  # file content; absent is an error below
        if kind != "qwen3_vl":
            raise CheckpointError(
                f"{cfg_file}: model_type {kind!r} is not a {self.name} model (expected 'qwen3_vl'). "
                f"Fix: set model.family to match the checkpoint."
            )
        cfg = Qwen3VLConfig.from_pretrained(str(path))
        cfg._attn_implementation = attn_implementation
        return cfg

    # --- modules -------------------------------------------------------------------------------
    def modules_for(self, hf_config: Qwen3VLConfig) -> tuple[str, ...]:
        """Both modules (a Qwen3-VL config always has a vision tower)."""
        return self.module_names

    def build_module(
        self, name: str, hf_config: Qwen3VLConfig, *, device: torch.device | str, dtype: torch.dtype
    ) -> nn.Module:
        """Build ``vision`` or ``llm`` alone on ``device``; on ``meta`` no memory is allocated.

        On a real device the weights get transformers' random init (directly on that device). The other
        module is never built. ``hf_config`` is not mutated.
        """
        # reason: transformers' model code costs ~2.3 CPU-s to import; the driver reads this family's
        # names, configs and hand-offs but builds nothing, so only what builds a module loads it
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel, Qwen3VLVisionModel

        from dhp.models.qwen3_vision.modules import VisionModule
        from dhp.models.qwen3_vl.modules import LLMModule

        if name not in self.module_names:
            raise ConfigError(
                [
                    ConfigIssue(
                        "modules", name, f"{self.name} has modules {self.module_names}", "use vision and llm"
                    )
                ]
            )
        cfg = copy.deepcopy(hf_config)
        with torch.device(device):
            if name == "vision":
                visual = Qwen3VLVisionModel._from_config(cfg.vision_config, dtype=dtype)
                module = VisionModule(visual, num_deepstack=len(cfg.vision_config.deepstack_visual_indexes))
            else:
                text_cfg = cfg.text_config
                language_model = Qwen3VLTextModel._from_config(text_cfg, dtype=dtype)
                module = LLMModule(language_model, lm_head(text_cfg, device=device, dtype=dtype), cfg)
                self.tie(name, module, cfg)
        module.parallel_plan = self.parallel_plan(name, cfg)  # what dhp.parallel shards, by FQN
        return module

    def tied_parameters(self, name: str, hf_config: Qwen3VLConfig) -> dict[str, str]:
        """``{"lm_head.weight": "language_model.embed_tokens.weight"}`` when embeddings are tied."""
        if name == "llm" and hf_config.tie_word_embeddings:
            return dict(TIED_LM_HEAD)
        return {}

    def tie(self, name: str, module: nn.Module, hf_config: Qwen3VLConfig) -> None:
        """Make tied parameters share storage again (after building or ``to_empty``)."""
        if self.tied_parameters(name, hf_config):
            tie_lm_head(module)

    def init_buffers(self, name: str, module: nn.Module) -> None:
        """Recompute the rotary ``inv_freq`` buffers after ``to_empty`` (vision ``axial``, text ``default``)."""
        init_rotary_buffers(self.name, name, module)

    # --- checkpoint keys and the HF export name map --------------------------------------------
    def checkpoint_owner(self, key: str) -> tuple[str, str] | None:
        """Checkpoint key -> ``(module_name, module_fqn)``; None if no module owns it."""
        return KEYS.owner(key)

    def hf_key(self, module: str, fqn: str) -> str:
        """``(module_name, module_fqn)`` -> the released checkpoint's key (inverse of ``checkpoint_owner``)."""
        return KEYS.hf_key(module, fqn)

    def split_state_dict(
        self, ref_state_dict: Mapping[str, torch.Tensor]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Reference (or checkpoint) state dict -> ``{"vision": {...}, "llm": {...}}`` keyed by module FQN."""
        return KEYS.split(ref_state_dict, self.module_names)

    def reference_model(self, hf_config: Qwen3VLConfig) -> Qwen3VLForConditionalGeneration:
        """The untouched transformers model, randomly initialised on CPU in the config's dtype."""
        # reason: transformers' model code costs ~2.3 CPU-s to import; the driver reads this family's
        # names, configs and hand-offs but builds nothing, so only what builds a module loads it
        from transformers import Qwen3VLForConditionalGeneration

        return reference_model(Qwen3VLForConditionalGeneration, hf_config)


FAMILY = Qwen3VLFamily
