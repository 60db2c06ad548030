"""What a model family inherits instead of writing: the defaults every current family shares.

:class:`FamilyBase` gives a :class:`~dhp.models.family.ModelFamily` everything that follows from a few
declared facts: the checkpoint key prefixes (``checkpoint_keys``: key <-> module FQN, the HF export name
map), the ``config.json`` model types it reads (``model_types``), the tiny model's ``conf/model`` entry,
and Qwen's special tokens and image processor. It also holds the ``build_module`` skeleton (refuse a
module the config lacks, build the rest on ``device`` from a copy of the config, re-tie, attach the
runtime parallel plan). A family writes only what is its own: ``hf_config``, the transformers config
class of a model type (``read_hf_config``), ``new_module``, ``parallel_plan``, the graph and the SP cut
of its inputs, and the reference model's class. Family-neutral: names no family.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from dhp.config.schema import ModelConfig
from dhp.errors import CheckpointError, ConfigError, ConfigIssue
from dhp.models.checks import image_token_counts
from dhp.models.common import (
    TIED_LM_HEAD,
    KeyMap,
    blank_image,
    init_rotary_buffers,
    reference_model,
    tie_parameters,
)
from dhp.models.entries import model_entry
from dhp.models.tokens import TOKEN_STRINGS
from dhp.parallel.module_plan import ModuleParallelPlan

#: checkpoint prefix -> (module, module FQN prefix) of a VLM saved by transformers 5 (first match wins)
VL_CHECKPOINT_KEYS = (
    ("model.visual.", "vision", "visual."),
    ("model.language_model.", "llm", "language_model."),
    ("lm_head.", "llm", "lm_head."),
)


class FamilyBase:
    """Defaults of a vision -> LLM family; a subclass declares ``name``, ``model_types`` and the hooks.

    ``FamilyBase(name)``: the family under another name it answers to (a flavour's, e.g. a model type
    that selects one flavour of the family); that name then appears in its messages and picks its tiny
    model (``tiny_<name>``).
    """

    name: str
    module_names: tuple[str, ...] = ("vision", "llm")
    checkpoint_keys: tuple[tuple[str, str, str], ...] = VL_CHECKPOINT_KEYS
    #: ``config.json`` model_type values :meth:`hf_config_from_dir` reads
    model_types: tuple[str, ...] = ()
    #: the ``conf/model`` entry of the tiny test model; None: ``tiny_<name>``
    tiny_entry: str | None = None

    def __init__(self, name: str | None = None) -> None:
        if name is not None:
            self.name = name

    # --- hooks a family writes -------------------------------------------------------------------
    def hf_config(self, model_cfg: ModelConfig) -> PretrainedConfig:
        """The transformers config for the schema's architecture numbers, dtype and attention."""
        raise NotImplementedError

    def read_hf_config(self, model_type: str, path: Path, raw: Mapping[str, Any]) -> PretrainedConfig:
        """The transformers config of a directory whose ``config.json`` (``raw``) has ``model_type``."""
        raise NotImplementedError

    def new_module(
        self, name: str, hf_config: PretrainedConfig, *, device: torch.device | str, dtype: torch.dtype
    ) -> nn.Module:
        """Module ``name`` of ``hf_config`` (a copy the family may keep), built under ``torch.device(device)``."""
        raise NotImplementedError

    def parallel_plan(self, name: str, hf_config: PretrainedConfig) -> ModuleParallelPlan:
        """TP styles by FQN, attention sites for SP, FSDP blocks, loss and ties of module ``name``."""
        raise NotImplementedError

    def reference_class(self, hf_config: PretrainedConfig) -> type[nn.Module]:
        """The transformers class of the whole model (parity, ``dhp verify``, the HF export's key names)."""
        raise NotImplementedError

    # --- producer inputs of a Qwen-style encoder (driver side, pure) ------------------------------
    def tokens_per_image(self, hf_config: PretrainedConfig, image_grid_thw: torch.Tensor) -> list[int]:
        """``t*h*w / spatial_merge_size**2`` merged tokens per image."""
        return image_token_counts(image_grid_thw, hf_config.vision_config.spatial_merge_size)

    def blank_image(self, hf_config: PretrainedConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """One merge unit of zero patches: ``(m*m, C*T*P*P)`` and grid ``[[1, m, m]]``."""
        return blank_image(hf_config.vision_config)

    # --- any producer's items (the runtime's generic calls; the defaults are the image encoder's) ---
    def tokens_per_item(self, name: str, hf_config: PretrainedConfig, meta: torch.Tensor) -> list[int]:
        """Hand-off rows per item of producer ``name`` from its meta rows (an image's ``(t, h, w)`` grid)."""
        return self.tokens_per_image(hf_config, meta)

    def shard_items(
        self, name: str, hf_config: PretrainedConfig, *, rows: torch.Tensor, meta: torch.Tensor, sp_size: int
    ) -> list[Any]:
        """Producer ``name``'s SP cut of one replica's items (input rows, meta rows) over ``sp_size`` ranks."""
        return self.shard_inputs(name, hf_config, pixel_values=rows, image_grid_thw=meta, sp_size=sp_size)

    def blank_input(self, name: str, hf_config: PretrainedConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest valid ``(input rows, meta rows)`` of producer ``name`` (FSDP replicas without items)."""
        return self.blank_image(hf_config)

    # --- data glue -------------------------------------------------------------------------------
    def token_strings(self) -> dict[str, str]:
        """The tokenizer's text of the special tokens the graph relies on (Qwen's, ``dhp.models.tokens``)."""
        return dict(TOKEN_STRINGS)

    def video_with_audio_ids(
        self, hf_config: PretrainedConfig, *, grid: tuple[int, int, int], seconds: float, audio_tokens: int
    ) -> list[int] | None:
        """The token ids a video interleaved with its own audio track takes between its vision-start and
        vision-end tokens, as the family's HF processor writes them with ``use_audio_in_video``
        (``grid``: the video's ``(t, h, w)`` patches; ``seconds``: seconds per temporal grid;
        ``audio_tokens``: the track's LLM tokens). None by default: the family does not lay out a video
        with its audio, and a record asking for it is refused by name."""
        return None

    def load_image_processor(self, model_path: str, *, min_pixels: int, max_pixels: int) -> Any:
        """transformers' Qwen2-VL PIL image processor from ``preprocessor_config.json`` (no torchvision;
        Qwen2.5-VL, Qwen3-VL and Qwen3.5 ship this class, with patch 14 or 16)."""
        # reason: that module loads transformers' model code (~2.3 CPU-s), which the driver does not need
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil.from_pretrained(
            model_path, min_pixels=min_pixels, max_pixels=max_pixels
        )

    def finish_export(self, out_dir: Path) -> None:
        """Nothing to add by default: the export keeps the checkpoint's own processor files."""

    # --- configs ---------------------------------------------------------------------------------
    def hf_config_from_dir(self, path: str | Path, *, attn_implementation: str = "sdpa") -> PretrainedConfig:
        """Read ``config.json`` of a local HF directory; its model_type must be one of ``model_types``."""
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{cfg_file} not found. Fix: point model.path at a HF model directory.")
        raw = json.loads(cfg_file.read_text())
        kind = raw.get("model_type")  # file content, not our config: absent is an error below
        if kind not in self.model_types:
            raise CheckpointError(
                f"{cfg_file}: model_type {kind!r} is not a {self.name} model (expected one of "
                f"{list(self.model_types)}). Fix: set model.family to match the checkpoint."
            )
        cfg = self.read_hf_config(kind, Path(path), raw)
        cfg._attn_implementation = attn_implementation
        return cfg

    def tiny_model_config(self) -> ModelConfig:
        """The tiny test architecture: ``conf/model/<tiny_entry>.yaml``, where its numbers are written."""
        return model_entry(self.tiny_entry or f"tiny_{self.name}")

    # --- modules ---------------------------------------------------------------------------------
    def modules_for(self, hf_config: PretrainedConfig) -> tuple[str, ...]:
        """The modules a given config has (all of ``module_names`` unless a family says otherwise)."""
        return self.module_names

    def build_module(
        self, name: str, hf_config: PretrainedConfig, *, device: torch.device | str, dtype: torch.dtype
    ) -> nn.Module:
        """Build module ``name`` alone on ``device``; on ``meta`` no memory is allocated.

        On a real device the weights get transformers' random init, directly on that device. The other
        modules are never built; ``hf_config`` is not mutated. The module carries its runtime plan
        (``module.parallel_plan``: what ``dhp.parallel`` shards, by FQN).
        """
        have = self.modules_for(hf_config)
        if name not in have:
            raise ConfigError(
                [
                    ConfigIssue(
                        path="modules",
                        value=name,
                        rule=f"this {self.name} config ({type(hf_config).__name__}) has modules {have}",
                        fix="remove this module from modules, or use a checkpoint that has it",
                    )
                ]
            )
        cfg = copy.deepcopy(hf_config)
        with torch.device(device):
            module = self.new_module(name, cfg, device=device, dtype=dtype)
        self.tie(name, module, cfg)
        module.parallel_plan = self.parallel_plan(name, cfg)
        return module

    def tied_parameters(self, name: str, hf_config: PretrainedConfig) -> dict[str, str]:
        """``{"lm_head.weight": "language_model.embed_tokens.weight"}`` when embeddings are tied."""
        # a transformers config attribute (absent on a bare text config means "not tied")
        if name == self.module_names[-1] and getattr(hf_config, "tie_word_embeddings", False):  # lm_head's
            return dict(TIED_LM_HEAD)
        return {}

    def tie(self, name: str, module: nn.Module, hf_config: PretrainedConfig) -> None:
        """Make tied parameters share storage again (after building or ``to_empty``)."""
        tie_parameters(module, self.tied_parameters(name, hf_config))

    def init_buffers(self, name: str, module: nn.Module) -> None:
        """Recompute the rotary ``inv_freq`` buffers after ``to_empty`` (``common.init_rotary_buffers``)."""
        init_rotary_buffers(self.name, name, module)

    # --- checkpoint keys and the HF export name map ----------------------------------------------
    @property
    def keys(self) -> KeyMap:
        """Checkpoint keys <-> module FQNs (``checkpoint_keys``)."""
        return KeyMap(family=self.name, owners=self.checkpoint_keys)

    def checkpoint_owner(self, key: str) -> tuple[str, str] | None:
        """Checkpoint key -> ``(module_name, module_fqn)``; None if no module owns it."""
        return self.keys.owner(key)

    def hf_key(self, module: str, fqn: str) -> str:
        """``(module_name, module_fqn)`` -> the released checkpoint's key (inverse of ``checkpoint_owner``)."""
        return self.keys.hf_key(module, fqn)

    def split_state_dict(
        self, ref_state_dict: Mapping[str, torch.Tensor]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Reference (or checkpoint) state dict -> ``{module: {module_fqn: tensor}}``."""
        return self.keys.split(ref_state_dict, self.module_names)

    def reference_kwargs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The whole batch's inputs (token tensors, ``mm_token_type_ids``, images and videos apart, audio
        features padded with their mask) as :meth:`reference_class`'s forward names them; as given by
        default (transformers' vision-language models)."""
        return inputs

    def reference_model(self, hf_config: PretrainedConfig) -> nn.Module:
        """The untouched transformers model, randomly initialised on CPU in the config's dtype."""
        return reference_model(self.reference_class(hf_config), hf_config)
