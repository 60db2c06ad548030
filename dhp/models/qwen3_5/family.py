"""Qwen3.5 (dense and MoE) as a :class:`~dhp.models.family.ModelFamily`: ``vision`` -> ``image_embeds`` -> ``llm``.

The two flavours share the encoder and the whole hybrid LLM; the MoE flavour (declared by
``model.llm.extra.num_experts``, a ``qwen3_5_moe`` checkpoint) builds transformers'
``Qwen3_5MoeForConditionalGeneration`` classes, whose every layer's MLP is a sparse MoE block (router,
routed experts, gated shared expert). Its LLM plan declares those blocks for expert parallelism
(``moe_blocks``: ``dhp.parallel`` swaps their ``experts`` for expert-parallel ones when
``parallel.ep > 1``; router, shared expert and its gate keep the module's own TP/FSDP/DP).

One edge: ``image_embeds`` (placed at the image tokens of the input embeddings), layout
``image_tokens`` (one row per merged image token, micro-batch order), width = the LLM hidden size, with
a gradient back to the encoder. The encoder is the shared Qwen3 one without DeepStack
(``dhp/models/qwen3_vision``); the LLM is the hybrid Gated DeltaNet / gated attention text model.

Checkpoint layout (transformers 5.x, as released): ``model.visual.*``, ``model.language_model.*``,
``lm_head.*``; in the MoE flavour as transformers 5 holds them, the experts of layer i are
``model.language_model.layers.{i}.mlp.experts.gate_up_proj`` [E, 2I, H] and ``...experts.down_proj``
[E, H, I] (whole tensors: an EP rank reads its rows). The released MoE checkpoints store one tensor per
expert (``...mlp.experts.{j}.gate_proj.weight`` ...), which transformers 5 fuses on load (its conversion
mapping for ``qwen3_5_moe_text``); dhp's loader reads the fused layout only, the per-expert one not yet. The release also stores a multi-token-prediction head (``mtp.*``), which transformers'
``Qwen3_5ForConditionalGeneration`` ignores on load; it is not part of the module graph either.
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
from transformers import (
    Qwen3_5Config,
    Qwen3_5MoeConfig,
)

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
from dhp.models.qwen3_5.arch import numbers, validate
from dhp.models.qwen3_5.config import build_hf_config
from dhp.models.qwen3_5.tp import llm_tp_plan, moe_llm_tp_plan
from dhp.models.qwen3_vision.arch import IMAGE_EMBEDS
from dhp.models.qwen3_vision.sp import Qwen3VisionShard, blank_image, shard_images, tokens_per_image
from dhp.models.qwen3_vision.tp import vision_parallel_plan
from dhp.models.tokens import TOKEN_STRINGS

if TYPE_CHECKING:
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

IMAGE_TOKENS = "image_tokens"

#: checkpoint prefix -> (module, module FQN prefix)
KEYS = KeyMap(
    family="qwen3_5",
    owners=(
        ("model.visual.", "vision", "visual."),
        ("model.language_model.", "llm", "language_model."),
        ("lm_head.", "llm", "lm_head."),
    ),
)
#: the release's multi-token-prediction head (``mtp.*``): owned by ``mtp``, a module this graph never
#: builds (transformers' Qwen3_5ForConditionalGeneration drops these keys on load too), so loading reads
#: them into no module instead of refusing the released directory
MTP_PREFIX, MTP_MODULE = "mtp.", "mtp"
#: the MoE flavour's sparse blocks in the LLM module (``gate`` router + ``experts`` + shared expert)
MOE_BLOCKS = "language_model.layers.*.mlp"
#: ``config.json`` model_type of each flavour
MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")


def is_moe_config(hf_config: Qwen3_5Config | Qwen3_5MoeConfig) -> bool:
    """Whether a transformers config is the MoE flavour."""
    return isinstance(hf_config, Qwen3_5MoeConfig)


def _plain(model_cfg: Any) -> Any:
    """A ModelConfig dataclass as a DictConfig (the arch functions read attributes and ``extra`` maps)."""
    return OmegaConf.structured(model_cfg) if dataclasses.is_dataclass(model_cfg) else model_cfg


class Qwen3_5Family:
    """Qwen3.5: ``vision`` (ViT + merger) feeds ``image_embeds`` to the hybrid ``llm``."""

    name = "qwen3_5"
    module_names = ("vision", "llm")

    # --- graph ---------------------------------------------------------------------------------
    def handoffs_for(self, hf_config: Qwen3_5Config) -> tuple[HandOff, ...]:
        """``image_embeds``: vision -> llm, layout ``image_tokens``, the LLM width, with a gradient."""
        width = hf_config.vision_config.out_hidden_size
        return (HandOff("vision", "llm", IMAGE_EMBEDS, IMAGE_TOKENS, width=width, grad=True),)

    # --- producer inputs (driver side, pure) ---------------------------------------------------
    def shard_inputs(
        self,
        name: str,
        hf_config: Qwen3_5Config,
        *,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor,
        sp_size: int,
    ) -> list[Qwen3VisionShard]:
        """Contiguous, merge-unit-aligned SP cut of one micro-batch's patches (``sp.shard_images``)."""
        return shard_images(pixel_values, image_grid_thw, sp_size=sp_size, config=hf_config.vision_config)

    def tokens_per_image(self, hf_config: Qwen3_5Config, image_grid_thw: torch.Tensor) -> list[int]:
        """``t*h*w / spatial_merge_size**2`` merged tokens per image."""
        return tokens_per_image(hf_config.vision_config, image_grid_thw)

    def blank_image(self, hf_config: Qwen3_5Config) -> tuple[torch.Tensor, torch.Tensor]:
        """One merge unit of zero patches: ``(m*m, C*T*P*P)`` and grid ``[[1, m, m]]``."""
        return blank_image(hf_config.vision_config)

    # --- parallel plans ------------------------------------------------------------------------
    def parallel_plan(self, name: str, hf_config: Qwen3_5Config) -> ModuleParallelPlan:
        """Encoder: the shared Qwen3 encoder plan (TP by FQN, Ulysses SP on every block's attention).
        LLM: TP of the gated attention, the Gated DeltaNet heads and the MLPs (``tp.py``), with Megatron
        sequence parallelism inside TP available; FSDP by decoder layer; the vocab-parallel loss."""
        if name == "vision":
            return vision_parallel_plan(hf_config.vision_config, deepstack=False)
        t = hf_config.text_config
        if is_moe_config(hf_config):
            return self._moe_llm_plan(name, hf_config)
        return ModuleParallelPlan(
            blocks=("language_model.layers.*",),
            tp=llm_tp_plan,
            tp_divides={
                "num_attention_heads": t.num_attention_heads,
                "num_key_value_heads": t.num_key_value_heads,
                "linear_num_key_heads": t.linear_num_key_heads,
                "linear_num_value_heads": t.linear_num_value_heads,
                "vocab_size": t.vocab_size,
                "intermediate_size": t.intermediate_size,
            },
            tp_sequence_parallel=True,
            loss=True,
            tied=self.tied_parameters(name, hf_config),
            pad_token_id=t.pad_token_id if t.pad_token_id is not None else 0,
        )

    def _moe_llm_plan(self, name: str, hf_config: Qwen3_5MoeConfig) -> ModuleParallelPlan:
        """The MoE flavour's LLM: TP of attention, DeltaNet heads and the shared expert, no sequence
        parallelism inside TP (``tp.moe_llm_tp_plan``); every layer's ``mlp`` declared for expert
        parallelism with its expert count (each EP rank keeps ``E/ep`` experts; router, shared expert
        and its gate stay with the module's TP/FSDP/DP)."""
        t = hf_config.text_config
        return ModuleParallelPlan(
            blocks=("language_model.layers.*",),
            tp=lambda sequence_parallel: moe_llm_tp_plan(),
            tp_divides={
                "num_attention_heads": t.num_attention_heads,
                "num_key_value_heads": t.num_key_value_heads,
                "linear_num_key_heads": t.linear_num_key_heads,
                "linear_num_value_heads": t.linear_num_value_heads,
                "vocab_size": t.vocab_size,
                "shared_expert_intermediate_size": t.shared_expert_intermediate_size,
            },
            tp_sequence_parallel=False,
            loss=True,
            tied=self.tied_parameters(name, hf_config),
            pad_token_id=t.pad_token_id if t.pad_token_id is not None else 0,
            moe_blocks=MOE_BLOCKS,
            experts=t.num_experts,
        )

    # --- data glue -----------------------------------------------------------------------------
    def token_strings(self) -> dict[str, str]:
        """The tokenizer's text of the special tokens the graph relies on (Qwen3.5 keeps Qwen's names)."""
        return dict(TOKEN_STRINGS)

    def finish_export(self, out_dir: Path) -> None:
        """Nothing to add: the export keeps the checkpoint's own processor files."""

    def load_image_processor(self, model_path: str, *, min_pixels: int, max_pixels: int) -> Any:
        """transformers' Qwen2-VL PIL image processor (Qwen3.5 ships the same class with patch 16)."""
        # reason: that module loads transformers' model code (~2.3 CPU-s), which the driver does not need
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil.from_pretrained(
            model_path, min_pixels=min_pixels, max_pixels=max_pixels
        )

    # --- configs -------------------------------------------------------------------------------
    def hf_config(self, model_cfg: Any) -> Qwen3_5Config | Qwen3_5MoeConfig:
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
        """The tiny test architecture: ``conf/model/tiny_qwen3_5.yaml`` (fp32), where its numbers are written."""
        return model_entry("tiny_qwen3_5")

    def tiny_hf_config(self, *, tie_word_embeddings: bool = False) -> Qwen3_5Config:
        """``hf_config(tiny_model_config())``, optionally with tied embeddings."""
        model_cfg = self.tiny_model_config()
        model_cfg.llm.tie_word_embeddings = tie_word_embeddings
        return self.hf_config(model_cfg)

    def tiny_moe_hf_config(self) -> Qwen3_5MoeConfig:
        """The tiny MoE flavour: ``hf_config(conf/model/tiny_qwen3_5_moe.yaml)``."""
        return self.hf_config(model_entry("tiny_qwen3_5_moe"))

    def hf_config_from_dir(
        self, path: str | Path, *, attn_implementation: str = "sdpa"
    ) -> Qwen3_5Config | Qwen3_5MoeConfig:
        """Read ``config.json`` of a local HF directory; it must be a ``qwen3_5`` or ``qwen3_5_moe`` model."""
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{cfg_file} not found. Fix: point model.path at a HF model directory.")
        kind = json.loads(cfg_file.read_text()).get("model_type")  # file content; absent is an error below
        if kind not in MODEL_TYPES:
            raise CheckpointError(
                f"{cfg_file}: model_type {kind!r} is not a {self.name} model (expected one of "
                f"{list(MODEL_TYPES)}). Fix: set model.family to match the checkpoint."
            )
        cls = Qwen3_5MoeConfig if kind == "qwen3_5_moe" else Qwen3_5Config
        cfg = cls.from_pretrained(str(path))
        cfg._attn_implementation = attn_implementation
        return cfg

    # --- modules -------------------------------------------------------------------------------
    def modules_for(self, hf_config: Qwen3_5Config) -> tuple[str, ...]:
        """Both modules (a Qwen3.5 config always has a vision tower)."""
        return self.module_names

    def build_module(
        self, name: str, hf_config: Qwen3_5Config, *, device: torch.device | str, dtype: torch.dtype
    ) -> nn.Module:
        """Build ``vision`` or ``llm`` alone on ``device``; on ``meta`` no memory is allocated.

        On a real device the weights get transformers' random init (directly on that device). The other
        module is never built. ``hf_config`` is not mutated.
        """
        # reason: transformers' model code costs ~2.3 CPU-s to import; the driver reads this family's
        # names, configs and hand-offs but builds nothing, so only what builds a module loads it
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel, Qwen3_5VisionModel
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeTextModel,
            Qwen3_5MoeVisionModel,
        )

        from dhp.models.qwen3_5.modules import LLMModule
        from dhp.models.qwen3_vision.modules import VisionModule

        if name not in self.module_names:
            raise ConfigError(
                [
                    ConfigIssue(
                        "modules", name, f"{self.name} has modules {self.module_names}", "use vision and llm"
                    )
                ]
            )
        cfg = copy.deepcopy(hf_config)
        moe = is_moe_config(cfg)
        with torch.device(device):
            if name == "vision":
                vision_cls = Qwen3_5MoeVisionModel if moe else Qwen3_5VisionModel
                visual = vision_cls._from_config(cfg.vision_config, dtype=dtype)
                module = VisionModule(visual, num_deepstack=0)
            else:
                text_cfg = cfg.text_config
                text_cls = Qwen3_5MoeTextModel if moe else Qwen3_5TextModel
                language_model = text_cls._from_config(text_cfg, dtype=dtype)
                module = LLMModule(language_model, lm_head(text_cfg, device=device, dtype=dtype), cfg)
                self.tie(name, module, cfg)
        module.parallel_plan = self.parallel_plan(name, cfg)  # what dhp.parallel shards, by FQN
        return module

    def tied_parameters(self, name: str, hf_config: Qwen3_5Config) -> dict[str, str]:
        """``{"lm_head.weight": "language_model.embed_tokens.weight"}`` when embeddings are tied."""
        if name == "llm" and hf_config.tie_word_embeddings:
            return dict(TIED_LM_HEAD)
        return {}

    def tie(self, name: str, module: nn.Module, hf_config: Qwen3_5Config) -> None:
        """Make tied parameters share storage again (after building or ``to_empty``)."""
        if self.tied_parameters(name, hf_config):
            tie_lm_head(module)

    def init_buffers(self, name: str, module: nn.Module) -> None:
        """Recompute the rotary ``inv_freq`` buffers after ``to_empty`` (vision ``axial``, text ``default``)."""
        init_rotary_buffers(self.name, name, module)

    # --- checkpoint keys and the HF export name map --------------------------------------------
    def checkpoint_owner(self, key: str) -> tuple[str, str] | None:
        """Checkpoint key -> ``(module_name, module_fqn)``; None if no module owns it. The release's
        ``mtp.*`` keys belong to ``mtp``, which is not in ``module_names``: no module loads them."""
        if key.startswith(MTP_PREFIX):
            return MTP_MODULE, key[len(MTP_PREFIX) :]
        return KEYS.owner(key)

    def hf_key(self, module: str, fqn: str) -> str:
        """``(module_name, module_fqn)`` -> the released checkpoint's key (inverse of ``checkpoint_owner``)."""
        return KEYS.hf_key(module, fqn)

    def split_state_dict(
        self, ref_state_dict: Mapping[str, torch.Tensor]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Reference (or checkpoint) state dict -> ``{"vision": {...}, "llm": {...}}`` keyed by module FQN."""
        return KEYS.split(ref_state_dict, self.module_names)

    def reference_model(
        self, hf_config: Qwen3_5Config | Qwen3_5MoeConfig
    ) -> Qwen3_5ForConditionalGeneration | Qwen3_5MoeForConditionalGeneration:
        """The untouched transformers model (the MoE class for an MoE config), randomly initialised on
        CPU in the config's dtype."""
        # reason: transformers' model code costs ~2.3 CPU-s to import; the driver reads this family's
        # names, configs and hand-offs but builds nothing, so only what builds a module loads it
        from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

        cls = (
            Qwen3_5MoeForConditionalGeneration
            if is_moe_config(hf_config)
            else Qwen3_5ForConditionalGeneration
        )
        return reference_model(cls, hf_config)


FAMILY = Qwen3_5Family
