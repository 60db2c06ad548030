"""Qwen3-VL-MoE as a :class:`~dhp.models.family.ModelFamily`: ``vision`` -> 1 + K edges -> ``llm``.

The encoder is the shared Qwen3 vision encoder with DeepStack (``dhp/models/qwen3_vision``), built from
transformers' ``Qwen3VLMoeVisionModel``; the LLM is ``Qwen3VLMoeTextModel`` + ``lm_head``
(``modules.LLMModule``: LM loss + the router's load-balancing loss). Edges: ``image_embeds`` and one
per DeepStack level ``deepstack_embeds_k``, all layout ``image_tokens``, width = the LLM hidden size,
with a gradient back to the encoder.

Parallel plan of the LLM: TP on attention (``tp.py``), the sparse blocks declared for expert
parallelism (``moe_blocks``: ``dhp.parallel`` swaps their ``experts`` for expert-parallel ones when
``parallel.ep > 1``; router and dense parts keep the module's own TP/FSDP/DP).

Checkpoint layout (transformers 5.x, as released): ``model.visual.*``, ``model.language_model.*``,
``lm_head.*``; the experts of layer i are ``model.language_model.layers.{i}.mlp.experts.gate_up_proj``
[E, 2I, H] and ``...experts.down_proj`` [E, H, I] (whole tensors: an EP rank reads its rows), the
router ``...mlp.gate.weight`` [E, H].
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
from transformers import Qwen3VLMoeConfig

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
from dhp.models.qwen3_vl_moe.arch import FAMILY_NAME, numbers, validate
from dhp.models.qwen3_vl_moe.config import build_hf_config
from dhp.models.qwen3_vl_moe.tp import llm_plan
from dhp.models.tokens import TOKEN_STRINGS

if TYPE_CHECKING:
    from transformers import Qwen3VLMoeForConditionalGeneration

IMAGE_TOKENS = "image_tokens"
#: the sparse-MoE blocks of the LLM module (each ``gate`` router + ``experts``; dense layers have none)
MOE_BLOCKS = "language_model.layers.*.mlp"

#: checkpoint prefix -> (module, module FQN prefix)
KEYS = KeyMap(
    family=FAMILY_NAME,
    owners=(
        ("model.visual.", "vision", "visual."),
        ("model.language_model.", "llm", "language_model."),
        ("lm_head.", "llm", "lm_head."),
    ),
)


def _plain(model_cfg: Any) -> Any:
    """A ModelConfig dataclass as a DictConfig (the arch functions read attributes and ``extra`` maps)."""
    return OmegaConf.structured(model_cfg) if dataclasses.is_dataclass(model_cfg) else model_cfg


def has_dense_layers(text_config: Any) -> bool:
    """Whether some decoder layer is a dense SwiGLU (transformers' rule, as ``arch.Numbers.is_sparse``)."""
    t = text_config
    return any(
        i in t.mlp_only_layers or t.num_experts == 0 or (i + 1) % t.decoder_sparse_step != 0
        for i in range(t.num_hidden_layers)
    )


class Qwen3VLMoeFamily:
    """Qwen3-VL-MoE: ``vision`` (ViT + merger + DeepStack mergers) feeds 1 + K tensors to ``llm`` (MoE)."""

    name = FAMILY_NAME
    module_names = ("vision", "llm")

    # --- graph ---------------------------------------------------------------------------------
    def handoffs_for(self, hf_config: Qwen3VLMoeConfig) -> tuple[HandOff, ...]:
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
        hf_config: Qwen3VLMoeConfig,
        *,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor,
        sp_size: int,
    ) -> list[Qwen3VisionShard]:
        """Contiguous, merge-unit-aligned SP cut of one micro-batch's patches (``qwen3_vision.sp``)."""
        return shard_images(pixel_values, image_grid_thw, sp_size=sp_size, config=hf_config.vision_config)

    def tokens_per_image(self, hf_config: Qwen3VLMoeConfig, image_grid_thw: torch.Tensor) -> list[int]:
        """``t*h*w / spatial_merge_size**2`` merged tokens per image."""
        return tokens_per_image(hf_config.vision_config, image_grid_thw)

    def blank_image(self, hf_config: Qwen3VLMoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """One merge unit of zero patches: ``(m*m, C*T*P*P)`` and grid ``[[1, m, m]]``."""
        return blank_image(hf_config.vision_config)

    # --- parallel plans ------------------------------------------------------------------------
    def parallel_plan(self, name: str, hf_config: Qwen3VLMoeConfig) -> ModuleParallelPlan:
        """Encoder: the shared Qwen3 vision plan (TP incl. DeepStack mergers, Ulysses SP).

        LLM: TP on attention (and on the dense layers' MLP), no sequence parallelism inside TP, the loss;
        the sparse blocks ``language_model.layers.*.mlp`` with their expert count for expert
        parallelism (``dhp.parallel.ep``: applied by ``dhp.parallel`` when ``parallel.ep > 1``, before
        TP; each EP rank keeps ``E/ep`` experts, the router stays replicated).
        """
        if name == "vision":
            return vision_parallel_plan(hf_config.vision_config, deepstack=True)
        t = hf_config.text_config
        dense = has_dense_layers(t)
        divides = {
            "num_attention_heads": t.num_attention_heads,
            "num_key_value_heads": t.num_key_value_heads,
            "vocab_size": t.vocab_size,
        }
        if dense:
            divides["intermediate_size"] = t.intermediate_size
        return ModuleParallelPlan(
            blocks=("language_model.layers.*",),
            tp=lambda sequence_parallel: llm_plan(dense_mlp=dense),
            tp_divides=divides,
            tp_sequence_parallel=False,
            loss=True,
            tied=self.tied_parameters(name, hf_config),
            pad_token_id=t.pad_token_id if t.pad_token_id is not None else 0,
            moe_blocks=MOE_BLOCKS,
            experts=t.num_experts,
        )

    # --- data glue -----------------------------------------------------------------------------
    def token_strings(self) -> dict[str, str]:
        """The tokenizer's text of the special tokens the graph relies on (Qwen3-VL-MoE keeps Qwen's)."""
        return dict(TOKEN_STRINGS)

    def finish_export(self, out_dir: Path) -> None:
        """Nothing to add: the export keeps the checkpoint's own processor files."""

    def load_image_processor(self, model_path: str, *, min_pixels: int, max_pixels: int) -> Any:
        """transformers' Qwen2-VL PIL image processor (Qwen3-VL-MoE ships the same class with patch 16)."""
        # deferred: the image processor is needed only on the data path, not to build or plan the model
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil.from_pretrained(
            model_path, min_pixels=min_pixels, max_pixels=max_pixels
        )

    # --- configs -------------------------------------------------------------------------------
    def hf_config(self, model_cfg: Any) -> Qwen3VLMoeConfig:
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
        """The tiny test architecture: ``conf/model/tiny_qwen3_vl_moe.yaml`` (fp32), where its numbers are written."""
        return model_entry("tiny_qwen3_vl_moe")

    def tiny_hf_config(self, *, tie_word_embeddings: bool = False) -> Qwen3VLMoeConfig:
        """``hf_config(tiny_model_config())``, optionally with tied embeddings."""
        model_cfg = self.tiny_model_config()
        model_cfg.llm.tie_word_embeddings = tie_word_embeddings
        return self.hf_config(model_cfg)

    def hf_config_from_dir(self, path: str | Path, *, attn_implementation: str = "sdpa") -> Qwen3VLMoeConfig:
        """Read ``config.json`` of a local HF directory; it must be a ``qwen3_vl_moe`` model."""
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{cfg_file} not found. Fix: point model.path at a HF model directory.")
        kind = json.loads(cfg_file.read_text()).get("model_type")  # file content; absent is an error below
        if kind != FAMILY_NAME:
            raise CheckpointError(
                f"{cfg_file}: model_type {kind!r} is not a {self.name} model (expected {FAMILY_NAME!r}). "
                f"Fix: set model.family to match the checkpoint."
            )
        cfg = Qwen3VLMoeConfig.from_pretrained(str(path))
        cfg._attn_implementation = attn_implementation
        return cfg

    # --- modules -------------------------------------------------------------------------------
    def modules_for(self, hf_config: Qwen3VLMoeConfig) -> tuple[str, ...]:
        """Both modules (a Qwen3-VL-MoE config always has a vision tower)."""
        return self.module_names

    def build_module(
        self, name: str, hf_config: Qwen3VLMoeConfig, *, device: torch.device | str, dtype: torch.dtype
    ) -> nn.Module:
        """Build ``vision`` or ``llm`` alone on ``device``; on ``meta`` no memory is allocated.

        On a real device the weights get transformers' random init (directly on that device). The other
        module is never built. ``hf_config`` is not mutated.
        """
        # reason: transformers' model code costs ~2.3 CPU-s to import; the driver reads this family's
        # names, configs and hand-offs but builds nothing, so only what builds a module loads it
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
            Qwen3VLMoeTextModel,
            Qwen3VLMoeVisionModel,
        )

        from dhp.models.qwen3_vision.modules import VisionModule
        from dhp.models.qwen3_vl_moe.modules import LLMModule

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
                visual = Qwen3VLMoeVisionModel._from_config(cfg.vision_config, dtype=dtype)
                module = VisionModule(visual, num_deepstack=len(cfg.vision_config.deepstack_visual_indexes))
            else:
                text_cfg = cfg.text_config
                language_model = Qwen3VLMoeTextModel._from_config(text_cfg, dtype=dtype)
                module = LLMModule(language_model, lm_head(text_cfg, device=device, dtype=dtype), cfg)
                self.tie(name, module, cfg)
        module.parallel_plan = self.parallel_plan(name, cfg)  # what dhp.parallel shards, by FQN
        return module

    def tied_parameters(self, name: str, hf_config: Qwen3VLMoeConfig) -> dict[str, str]:
        """``{"lm_head.weight": "language_model.embed_tokens.weight"}`` when embeddings are tied."""
        if name == "llm" and hf_config.tie_word_embeddings:
            return dict(TIED_LM_HEAD)
        return {}

    def tie(self, name: str, module: nn.Module, hf_config: Qwen3VLMoeConfig) -> None:
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

    def stored_dims(
        self, fqn: str, stored_shape: tuple[int, ...], shape: tuple[int, ...]
    ) -> tuple[int, ...] | None:
        """``(0, 2, 1)`` for an expert tensor stored transposed, else None (``dhp.models.loading``).

        The released checkpoints keep the experts as ``gate_up_proj`` [E, H, 2I] and ``down_proj``
        [E, I, H] (transformers 4.57's layout); transformers 5 holds, and dhp exports, [E, 2I, H] and
        [E, H, I]. As transformers' own loader, the layout is read from the shapes: a tensor whose last
        two dims are swapped is transposed on load (a square one, 2I == H or I == H, is taken as is).
        """
        if not fqn.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) or stored_shape == shape:
            return None
        if len(shape) == 3 and stored_shape == (shape[0], shape[2], shape[1]):
            return (0, 2, 1)
        return None

    def split_state_dict(
        self, ref_state_dict: Mapping[str, torch.Tensor]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Reference (or checkpoint) state dict -> ``{"vision": {...}, "llm": {...}}`` keyed by module FQN."""
        return KEYS.split(ref_state_dict, self.module_names)

    def reference_model(self, hf_config: Qwen3VLMoeConfig) -> Qwen3VLMoeForConditionalGeneration:
        """The untouched transformers model, randomly initialised on CPU in the config's dtype."""
        # reason: transformers' model code costs ~2.3 CPU-s to import; the driver reads this family's
        # names, configs and hand-offs but builds nothing, so only what builds a module loads it
        from transformers import Qwen3VLMoeForConditionalGeneration

        return reference_model(Qwen3VLMoeForConditionalGeneration, hf_config)


FAMILY = Qwen3VLMoeFamily
