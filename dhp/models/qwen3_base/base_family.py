"""The family side every Qwen3-style family shares: its graph, producer inputs, configs, modules, keys.

A Qwen3-style family is the Qwen3 vision encoder (``vision``: ``dhp/models/qwen3_vision``) feeding a
Qwen3 decoder (``llm``: :class:`~dhp.models.qwen3_base.llm.LLMModule`), in a dense and an MoE flavour.
:class:`Qwen3Family` is the whole :class:`~dhp.models.family.ModelFamily` over what a family declares:

- ``arch``: its :class:`~dhp.models.qwen3_base.arch.Qwen3Arch` (numbers, flavours, typed architecture,
  parallel axes: the runtime plans below take their divisibility facts from ``arch.axes_of``);
- ``configs``: per flavour (its ``model_type``) the transformers config class and the model class that
  ``config.json`` names;
- ``CLASSES`` in the family's ``modules.py`` (``{moe: Classes(...)}``): the transformers classes each
  flavour builds (that module loads transformers' model code, so only what builds a module imports it);
- :meth:`Qwen3Family.text_config` (its own ``text_config`` keys) and :meth:`Qwen3Family.llm_tp` (the
  decoder's TP styles by FQN glob).

Edges: ``image_embeds`` (placed at the image tokens of the input embeddings) and, with DeepStack, one
``deepstack_embeds_k`` per level (added to the hidden states at the image tokens after decoder layer k);
all layout ``image_tokens``, width = the LLM hidden size, with a gradient back to the encoder.
Checkpoint layout (transformers 5.x, as released): ``model.visual.*``, ``model.language_model.*``,
``lm_head.*``; an MoE layer's experts are ``...layers.{i}.mlp.experts.gate_up_proj`` [E, 2I, H] and
``...experts.down_proj`` [E, H, I] (whole tensors: an EP rank reads its rows), its router
``...mlp.gate.weight`` [E, H]. The releases that store one tensor per expert
(``...mlp.experts.{j}.gate_proj.weight`` / ``up_proj`` [I, H], ``down_proj`` [H, I]: Qwen3.5-MoE,
Qwen3-Omni) are folded into those on load (:data:`MOE_EXPERT_FOLDS`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn
from transformers import PretrainedConfig

from dhp.config.issues import Issues
from dhp.errors import ConfigError
from dhp.models.axes import runtime_plan
from dhp.models.common import ExpertFold, lm_head, vl_config
from dhp.models.dtypes import torch_dtype
from dhp.models.entries import model_entry
from dhp.models.family import HandOff
from dhp.models.family_base import FamilyBase
from dhp.models.qwen3_base.arch import Qwen3Arch, TextNumbers
from dhp.models.qwen3_base.config import text_config
from dhp.models.qwen3_base.tp import qwen3_decoder_tp_plan
from dhp.models.qwen3_vision.arch import edges
from dhp.models.qwen3_vision.config import vision_config_kwargs, vision_numbers_from_hf
from dhp.models.qwen3_vision.sp import Qwen3VisionShard, shard_images
from dhp.models.qwen3_vision.tp import vision_parallel_plan
from dhp.parallel.linear_attn_packed import split_packed_rows
from dhp.parallel.module_plan import ModuleParallelPlan
from dhp.parallel.plan_match import matching

IMAGE_TOKENS = "image_tokens"
#: the decoder layers (FSDP units) and, in the MoE flavour, their sparse blocks (``gate`` router +
#: ``experts``; dense layers have none) that expert parallelism swaps
LLM_BLOCKS = ("language_model.layers.*",)
MOE_BLOCKS = "language_model.layers.*.mlp"
#: the per-expert tensors of a release -> the fused ones the modules hold, as transformers 5 fuses them
#: on load (its ``qwen2_moe`` conversion mapping, which ``qwen3_omni_moe`` and ``qwen3_5_moe`` use):
#: gate then up on the rows (``gate, up = (x @ gate_up_proj[j].T).chunk(2, -1)``), down alone
MOE_EXPERT_FOLDS = (
    ExpertFold(
        fused="mlp.experts.gate_up_proj", experts="mlp.experts", parts=("gate_proj.weight", "up_proj.weight")
    ),
    ExpertFold(fused="mlp.experts.down_proj", experts="mlp.experts", parts=("down_proj.weight",)),
)


@dataclass(frozen=True)
class Classes:
    """The transformers classes one flavour builds: the encoder, the decoder, the model whose
    ``get_rope_index`` gives the M-RoPE positions, and the whole model (the reference)."""

    vision: type[nn.Module]
    text: type[nn.Module]
    rope_model: type[nn.Module]
    reference: type[nn.Module]


def _plain(model_cfg: Any) -> Any:
    """A ModelConfig dataclass as a DictConfig (the arch functions read attributes and ``extra`` maps)."""
    return OmegaConf.structured(model_cfg) if dataclasses.is_dataclass(model_cfg) else model_cfg


class Qwen3Family(FamilyBase):
    """A Qwen3-style family: ``vision`` (ViT + merger [+ DeepStack mergers]) feeds ``llm`` (the decoder).

    ``Qwen3Family(flavour_name)``: the family held to that flavour (``model.family: qwen3_vl_moe``): it
    reads only that flavour's checkpoints and its tiny model is that flavour's.
    """

    arch: Qwen3Arch
    #: FQN glob of the LLM's linear-attention layers (a hybrid decoder's); "" for an all-attention one
    linear_attention: str = ""
    #: flavour name (= ``model_type``) -> (transformers config class, the class ``config.json`` names)
    configs: Mapping[str, tuple[type[PretrainedConfig], str]]
    #: per-expert checkpoint tensors the loader folds into the fused experts (``dhp.models.loading``)
    expert_folds: tuple[ExpertFold, ...] = MOE_EXPERT_FOLDS

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        held = name is not None and name != type(self).name
        self.model_types = (name,) if held else tuple(self.configs)

    # --- the decoder's, by default the Qwen3 decoder's (``qwen3_base.decoder``) ------------------
    def text_config(self, n: Any) -> dict[str, Any]:
        """The transformers ``text_config`` keywords of numbers: the shared ones
        (``qwen3_base.config.text_config``), the dense width and, in the MoE flavour, the sparse-layer
        pattern (``output_router_logits`` stays transformers' default, false as released: the LLM
        module asks for the logits itself). A family with another decoder writes its own."""
        kwargs = text_config(n) | dict(intermediate_size=n.mlp)
        if n.moe:  # norm_topk_prob as released; transformers' router always renormalises
            kwargs |= dict(
                decoder_sparse_step=n.sparse_step, mlp_only_layers=list(n.mlp_only), norm_topk_prob=True
            )
        return kwargs

    def llm_tp(self, n: Any) -> Callable[[bool], Mapping[str, Any]]:
        """The decoder's TP styles by FQN glob, as a function of Megatron sequence parallelism (asked
        only where the declared axes allow it): the Qwen3 decoder's plan (``qwen3_base.tp``), with the
        dense MLP's globs where the typed blocks have a dense layer."""
        dense = any(b.mlp.kind == "dense" for b in self.arch.llm_arch(n).blocks)
        allowed = self.arch.axes_of("llm", n).tp_sequence_parallel
        return lambda sequence_parallel: qwen3_decoder_tp_plan(
            dense_mlp=dense, sequence_parallel=sequence_parallel and allowed
        )

    # --- flavours ------------------------------------------------------------------------------
    def is_moe(self, hf_config: PretrainedConfig) -> bool:
        """Whether a transformers config is the MoE flavour."""
        return hf_config.model_type == self.arch.moe.name

    def numbers(self, hf_config: PretrainedConfig) -> TextNumbers:
        return self.arch.numbers_from_hf(hf_config)

    def classes(self, hf_config: PretrainedConfig) -> Classes:
        """The flavour's transformers classes (``CLASSES`` of the family's ``modules.py``)."""
        # reason: transformers' model code costs ~2.3 CPU-s to import; the driver reads this family's
        # names, configs and hand-offs but builds nothing, so only what builds a module loads it
        package = type(self).__module__.rpartition(".")[0]
        return importlib.import_module(f"{package}.modules").CLASSES[self.is_moe(hf_config)]

    def _levels(self, hf_config: PretrainedConfig) -> int:
        v = hf_config.vision_config
        return len(v.deepstack_visual_indexes) if self.arch.deepstack else 0

    # --- graph and producer inputs (driver side, pure) -----------------------------------------
    def handoffs_for(self, hf_config: PretrainedConfig) -> tuple[HandOff, ...]:
        """``image_embeds`` then ``deepstack_embeds_0 .. K-1``: vision -> llm, ``image_tokens``, LLM width."""
        v = vision_numbers_from_hf(hf_config.vision_config, deepstack=self.arch.deepstack)
        return tuple(
            HandOff("vision", "llm", kwarg, IMAGE_TOKENS, width=v.out_hidden, grad=True) for kwarg in edges(v)
        )

    def shard_inputs(
        self,
        name: str,
        hf_config: PretrainedConfig,
        *,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor,
        sp_size: int,
    ) -> list[Qwen3VisionShard]:
        """Contiguous, merge-unit-aligned SP cut of one micro-batch's patches (``qwen3_vision.sp``)."""
        return shard_images(pixel_values, image_grid_thw, sp_size=sp_size, config=hf_config.vision_config)

    # --- parallel plans ------------------------------------------------------------------------
    def parallel_plan(self, name: str, hf_config: PretrainedConfig) -> ModuleParallelPlan:
        """Encoder: the shared Qwen3 encoder plan (TP by FQN, Ulysses SP on every block's attention).
        LLM: the family's TP styles, FSDP by decoder layer, the vocab-parallel loss and, in the MoE
        flavour, the sparse blocks with their expert count for expert parallelism (``dhp.parallel.ep``,
        applied when ``parallel.ep > 1``: each EP rank keeps ``E/ep`` experts, the router stays
        replicated). Every divisibility fact is the declared axes' (``arch.axes_of``)."""
        n = self.numbers(hf_config)
        axes = self.arch.axes_of(name, n)
        if name == "vision":
            return vision_parallel_plan(axes, deepstack=self.arch.deepstack)
        return runtime_plan(
            axes,
            blocks=LLM_BLOCKS,
            tp=self.llm_tp(n),
            loss=True,
            tied=self.tied_parameters(name, hf_config),
            pad_token_id=hf_config.text_config.pad_token_id,
            moe_blocks=MOE_BLOCKS,
            linear_attention=self.linear_attention,
        )

    # --- configs -------------------------------------------------------------------------------
    def hf_config(self, model_cfg: Any) -> PretrainedConfig:
        """The transformers config from the schema's numbers and ``extra`` maps (ConfigError if invalid):
        the flavour's config class (``Qwen3VLMoeConfig`` when the numbers declare experts)."""
        model = _plain(model_cfg)
        issues = Issues()
        self.arch.validate(model, issues)
        if issues.items:
            raise ConfigError(issues.items)
        n = self.arch.numbers(model)
        config_class, architecture = self.configs[self.arch.flavour(model).name]
        return vl_config(
            config_class,
            architecture=architecture,
            vision=vision_config_kwargs(n.vision, deepstack=self.arch.deepstack),
            text=self.text_config(n),
            tokens=model.tokens,
            tied=n.tied,
            attn_implementation=model.attn_implementation,
            dtype=torch_dtype(model.dtype),
        )

    def read_hf_config(self, model_type: str, path: Path, raw: Mapping[str, Any]) -> PretrainedConfig:
        return self.configs[model_type][0].from_pretrained(str(path))

    def tiny_hf_config(self, *, moe: bool = False, tie_word_embeddings: bool = False) -> PretrainedConfig:
        """``hf_config`` of the tiny model (``moe``: the MoE flavour's), optionally with tied embeddings."""
        model_cfg = model_entry(self.arch.moe.tiny) if moe else self.tiny_model_config()
        model_cfg.llm.tie_word_embeddings = tie_word_embeddings
        return self.hf_config(model_cfg)

    # --- modules -------------------------------------------------------------------------------
    def new_module(
        self, name: str, hf_config: PretrainedConfig, *, device: torch.device | str, dtype: torch.dtype
    ) -> nn.Module:
        """transformers' encoder in the shared wrapper, or its decoder + ``lm_head`` in :class:`LLMModule`
        (its linear-attention layers, if any, run a packed micro-batch one sample at a time:
        ``dhp.parallel.linear_attn_packed.split_packed_rows``)."""
        # reason: the wrappers load torch.distributed and the EP loss; the driver builds no module
        from dhp.models.qwen3_base.llm import LLMModule
        from dhp.models.qwen3_vision.modules import VisionModule

        classes = self.classes(hf_config)
        if name == "vision":
            visual = classes.vision._from_config(hf_config.vision_config, dtype=dtype)
            return VisionModule(visual, num_deepstack=self._levels(hf_config))
        text = hf_config.text_config
        llm = LLMModule(
            classes.text._from_config(text, dtype=dtype),
            lm_head(text, device=device, dtype=dtype),
            hf_config,
            rope_model=classes.rope_model,
            moe=self.is_moe(hf_config),
            num_deepstack=self._levels(hf_config),
            family=self.name,
        )
        for _, layer in matching(llm, (self.linear_attention,) if self.linear_attention else ()):
            split_packed_rows(layer)  # a packed micro-batch: each sample through the layer on its own
        return llm

    def reference_class(self, hf_config: PretrainedConfig) -> type[nn.Module]:
        """``...ForConditionalGeneration`` of the config's flavour."""
        return self.classes(hf_config).reference


def transposed_experts(
    fqn: str, stored_shape: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[int, ...] | None:
    """``(0, 2, 1)`` for an expert tensor stored transposed, else None (a family's ``stored_dims``).

    A release may keep the fused experts as ``gate_up_proj`` [E, H, 2I] and ``down_proj`` [E, I, H]
    (transformers 4.57's layout); transformers 5 holds, and dhp exports, [E, 2I, H] and [E, H, I]. As
    transformers' own loader, the layout is read from the shapes: a tensor whose last two dims are
    swapped is transposed on load (a square one, 2I == H or I == H, is taken as is).
    """
    if not fqn.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) or stored_shape == shape:
        return None
    if len(shape) == 3 and stored_shape == (shape[0], shape[2], shape[1]):
        return (0, 2, 1)
    return None
