"""Qwen3-VL as a :class:`~dhp.models.family.ModelFamily`: ``vision`` -> 1 + K edges -> ``llm``.

Edges: ``image_embeds`` (placed at the image tokens of the input embeddings) and one edge per DeepStack
level, ``deepstack_embeds_k`` (added to the hidden states at the image tokens after decoder layer k).
All have one row per image token in the micro-batch's image-token order, width = LLM hidden size, and
carry a gradient back to the encoder.

Checkpoint layout (transformers >= 4.57 / 5.x, as released): ``model.visual.*``,
``model.language_model.*``, ``lm_head.*``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel, Qwen3VLVisionModel

from dhp.errors import CheckpointError, ConfigError, ConfigIssue
from dhp.models.family import HandOff
from dhp.models.qwen2_5_vl.family import TINY_TOKENS
from dhp.models.qwen3_vl.arch import (
    TINY_ARCH,
    TINY_LLM,
    TINY_VISION,
    arch_issues,
    build_hf_config,
    torch_dtype,
)
from dhp.models.qwen3_vl.counts import Counts, Geometry, block_counts, geometry, largest_param, module_counts
from dhp.models.qwen3_vl.modules import IMAGE_EMBEDS, LLMModule, VisionModule, deepstack_kwarg

IMAGE_TOKENS = "image_tokens"  # hand-off layout: one row per merged image token, micro-batch order

# checkpoint prefix -> (module, module FQN prefix)
_OWNERS = (
    ("model.visual.", "vision", "visual."),
    ("model.language_model.", "llm", "language_model."),
    ("lm_head.", "llm", "lm_head."),
)


def _as_dict(node: Any) -> dict[str, Any]:
    """A schema block (dataclass, DictConfig or mapping) as a plain dict."""
    if dataclasses.is_dataclass(node):
        return dataclasses.asdict(node)
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)
    return dict(node)


class Qwen3VLFamily:
    """Qwen3-VL: ``vision`` (ViT + merger + DeepStack mergers) feeds 1 + K tensors to ``llm``."""

    name = "qwen3_vl"
    module_names = ("vision", "llm")

    # --- graph ---------------------------------------------------------------------------------
    def handoff_kwargs(self, hf_config: Qwen3VLConfig) -> tuple[str, ...]:
        """``("image_embeds", "deepstack_embeds_0", ..., "deepstack_embeds_{K-1}")`` for this config."""
        levels = len(hf_config.vision_config.deepstack_visual_indexes)
        return (IMAGE_EMBEDS, *(deepstack_kwarg(k) for k in range(levels)))

    def handoffs_for(self, hf_config: Qwen3VLConfig) -> tuple[HandOff, ...]:
        """One vision -> llm edge per kwarg, all layout ``image_tokens``, rows (N_image_tokens, llm hidden)."""
        return tuple(
            HandOff(producer="vision", consumer="llm", kwarg=kwarg, layout=IMAGE_TOKENS)
            for kwarg in self.handoff_kwargs(hf_config)
        )

    def handoff_width(self, hf_config: Qwen3VLConfig) -> int:
        """Columns of every edge: the LLM hidden size (the mergers' ``out_hidden_size``)."""
        return hf_config.vision_config.out_hidden_size

    # --- planner counts (from the schema's numbers; no module is built) ------------------------
    def module_params(self, name: str, model_cfg: Any) -> Counts:
        """Parameters of module ``name``, split into TP-sharded and TP-replicated."""
        return module_counts(name, self.hf_config(model_cfg))

    def layer_params(self, name: str, model_cfg: Any) -> Counts:
        """Parameters of one block of module ``name`` (the FSDP unit)."""
        return block_counts(name, self.hf_config(model_cfg))

    def largest_param(self, name: str, model_cfg: Any) -> int:
        """Elements of module ``name``'s largest parameter tensor."""
        return largest_param(name, self.hf_config(model_cfg))

    def layer_shape(self, name: str, model_cfg: Any) -> Geometry:
        """Block geometry of module ``name`` (hidden, MLP, q/kv widths, heads, head_dim, layers)."""
        return geometry(name, self.hf_config(model_cfg))

    # --- configs -------------------------------------------------------------------------------
    def validate_arch(self, model_cfg: Any) -> list[ConfigIssue]:
        """Every problem with the model block's numbers for this family (empty when valid)."""
        return arch_issues(_as_dict(model_cfg.vision), _as_dict(model_cfg.llm), _as_dict(model_cfg.arch))

    def hf_config(self, model_cfg: Any) -> Qwen3VLConfig:
        """Build the transformers config from the schema's numbers plus ``model.arch`` (no file is read)."""
        return build_hf_config(
            vision=_as_dict(model_cfg.vision),
            llm=_as_dict(model_cfg.llm),
            arch=_as_dict(model_cfg.arch),
            tokens=_as_dict(model_cfg.tokens),
            dtype=torch_dtype(model_cfg.dtype),
            attn_implementation=model_cfg.attn_implementation,
        )

    def tiny_hf_config(self, *, tie_word_embeddings: bool = False) -> Qwen3VLConfig:
        """The tiny test architecture (``conf/model/tiny_qwen3_vl.yaml``'s numbers), fp32, sdpa."""
        return build_hf_config(
            vision=TINY_VISION,
            llm={**TINY_LLM, "tie_word_embeddings": tie_word_embeddings},
            arch=TINY_ARCH,
            tokens=dataclasses.asdict(TINY_TOKENS),
            dtype=torch.float32,
            attn_implementation="sdpa",
        )

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
                return VisionModule(Qwen3VLVisionModel._from_config(cfg.vision_config, dtype=dtype))
            text_cfg = cfg.text_config
            language_model = Qwen3VLTextModel._from_config(text_cfg, dtype=dtype)
            lm_head = nn.Linear(text_cfg.hidden_size, text_cfg.vocab_size, bias=False, dtype=dtype)
            if not str(device).startswith("meta"):
                nn.init.normal_(lm_head.weight, std=text_cfg.initializer_range)
            module = LLMModule(language_model, lm_head, cfg)
            self.tie(name, module, cfg)
            return module

    def tied_parameters(self, name: str, hf_config: Qwen3VLConfig) -> dict[str, str]:
        """``{"lm_head.weight": "language_model.embed_tokens.weight"}`` when embeddings are tied."""
        if name == "llm" and hf_config.tie_word_embeddings:
            return {"lm_head.weight": "language_model.embed_tokens.weight"}
        return {}

    def tie(self, name: str, module: nn.Module, hf_config: Qwen3VLConfig) -> None:
        """Make tied parameters share storage again (after building or ``to_empty``)."""
        if self.tied_parameters(name, hf_config):
            module.lm_head.weight = module.language_model.embed_tokens.weight

    def init_buffers(self, name: str, module: nn.Module) -> None:
        """Recompute the rotary ``inv_freq`` buffers (non-persistent) as transformers' init does.

        The vision rotary is ``axial`` (2D h/w), the text one ``default`` (interleaved M-RoPE). Any
        other non-persistent buffer would be left unset after ``to_empty``, so it is an error here.
        """
        handled = set()
        with torch.no_grad():
            for path, sub in module.named_modules():
                if "RotaryEmbedding" not in type(sub).__name__:
                    continue
                if sub.rope_type == "axial":
                    value, _ = sub.compute_axial_rope_parameters(sub.config)
                elif sub.rope_type == "default":
                    value, _ = sub.compute_default_rope_parameters(sub.config)
                else:
                    value, _ = ROPE_INIT_FUNCTIONS[sub.rope_type](sub.config)
                for buf in ("inv_freq", "original_inv_freq"):
                    getattr(sub, buf).copy_(value)
                    handled.add(f"{path}.{buf}")
        persistent = set(module.state_dict())
        left = [n for n, _ in module.named_buffers() if n not in persistent and n not in handled]
        if left:
            raise CheckpointError(f"{name}: non-persistent buffers {left} have no initialiser in {self.name}")

    # --- checkpoint keys -----------------------------------------------------------------------
    def checkpoint_owner(self, key: str) -> tuple[str, str] | None:
        """Checkpoint key -> ``(module_name, module_fqn)``; None if no module owns it."""
        for prefix, module, fqn_prefix in _OWNERS:
            if key.startswith(prefix):
                return module, fqn_prefix + key[len(prefix) :]
        return None

    def hf_key(self, module: str, fqn: str) -> str:
        """``(module_name, module_fqn)`` -> the released checkpoint's key (the HF export name map)."""
        for prefix, owner, fqn_prefix in _OWNERS:
            if owner == module and fqn.startswith(fqn_prefix):
                return prefix + fqn[len(fqn_prefix) :]
        raise CheckpointError(f"{self.name}: no checkpoint key for {module}.{fqn}")

    def split_state_dict(
        self, ref_state_dict: Mapping[str, torch.Tensor]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Reference (or checkpoint) state dict -> ``{"vision": {...}, "llm": {...}}`` keyed by module FQN."""
        out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in self.module_names}
        unowned = []
        for key, tensor in ref_state_dict.items():
            owner = self.checkpoint_owner(key)
            if owner is None:
                unowned.append(key)
                continue
            out[owner[0]][owner[1]] = tensor
        if unowned:
            raise CheckpointError(f"keys that belong to no {self.name} module: {sorted(unowned)}")
        return out

    def reference_model(self, hf_config: Qwen3VLConfig) -> Qwen3VLForConditionalGeneration:
        """The untouched transformers model, randomly initialised on CPU in the config's dtype."""
        cfg = copy.deepcopy(hf_config)
        return Qwen3VLForConditionalGeneration._from_config(cfg, dtype=cfg.dtype)
