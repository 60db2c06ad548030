"""The model-family protocol: a model as a graph of modules that run in different processes.

A family names its modules (each becomes one actor group with its own world and parallelism), the
hand-offs between them (what tensor flows from which producer to which consumer), and how each
module is built alone (meta device first) and fed its own checkpoint tensors. Nothing here knows
about parallelism: ``dhp/parallel`` wraps the modules a family builds.

Shape of a family (see :class:`ModelFamily`; docs/INTERFACES.md "Module graph"):

- graph: ``module_names`` (producers first) and ``handoffs_for(hf_config)`` (``HandOff(producer,
  consumer, kwarg, layout, width, grad)``); a producer's forward returns ``{kwarg: tensor}``, the
  consumer takes each tensor as a keyword argument and its backward yields the gradients the
  producer backpropagates;
- producer inputs: ``shard_inputs`` (the SP cut), ``tokens_per_image``, ``blank_image``;
- configs: ``hf_config(model_cfg)`` from the schema, ``hf_config_from_dir(path)`` from a HF
  directory, ``tiny_model_config()`` for tests;
- modules: ``build_module(name, hf_config, device=, dtype=)`` (meta allocates nothing), carrying the
  runtime parallel plan as ``module.parallel_plan`` (TP styles by FQN, attention sites for SP, blocks;
  its divisibility facts are the family's declared ``module_axes``, ``dhp.models.axes``);
  ``tied_parameters`` (re-shared by ``common.tie_parameters``);
- checkpoint: ``checkpoint_owner(key) -> (module, fqn)``; ``dhp.models.loading`` does the rest
  (only this module's keys are read, missing/unexpected keys are listed, ties and rotary buffers
  restored);
- reference: ``reference_model(hf_config)`` and ``split_state_dict`` for parity and HF export;
- data: ``token_strings()``, ``load_image_processor(...)``; export: ``finish_export``.

A family is a folder ``dhp/models/<name>/`` with ``family.py`` (``FAMILY``) and a torch-free
``arch.py`` (``ARCH``, see ``dhp.models.arch``); ``dhp.models.registry`` finds it by its folder.
Most members have a default in :class:`dhp.models.family_base.FamilyBase`; the Qwen3-style families
inherit the rest from ``dhp.models.qwen3_base``. An audio encoder is one more module name
(``audio``) and one more hand-off (``HandOff("audio", "llm", "audio_embeds", ...)``); the LLM module
takes ``audio_embeds`` and places them at its audio-token positions. The runtime walks
``module_names`` and the edges.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from dhp.ops.packed import AUDIO, IMAGE, VIDEO
from dhp.parallel.module_plan import AttentionSite, ModuleParallelPlan  # re-exported for the families

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from dhp.config.schema import ModelConfig


@dataclass(frozen=True)
class RowLayout:
    """A hand-off layout: the order of its rows, and what of a micro-batch its producer reads.

    The producer's input is a stream of items (an image or video; an audio): ``rows_field`` is the
    batch field holding every item's input rows concatenated on dim 0, ``meta_field`` the one holding
    one meta row per item whose product is that item's input-row count (an image's ``(t, h, w)``
    patch grid; an audio's ``(frames,)``). ``token_types``: the ``mm_token_type_ids`` values of the
    consumer positions that take the rows, in order (layout row i goes to the i-th such position).
    """

    rows_field: str
    meta_field: str
    token_types: tuple[int, ...]

    def items(self, batch: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(input rows, meta rows)`` of a micro-batch (both None: no item of this layout)."""
        return getattr(batch, self.rows_field), getattr(batch, self.meta_field)

    def positions(self, mm_token_type_ids: torch.Tensor) -> torch.Tensor:
        """Bool mask of the consumer positions this layout's rows land on."""
        return torch.isin(mm_token_type_ids, torch.tensor(self.token_types, device=mm_token_type_ids.device))


#: hand-off layouts the runtime can route. ``image_tokens``: one row per merged image (or video) token,
#: rows in the micro-batch's visual-token order (item after item); ``audio_tokens``: one row per audio
#: token, audio after audio. The consumer places row i at the i-th position of the layout's token types.
LAYOUTS: Mapping[str, RowLayout] = {
    "image_tokens": RowLayout("pixel_values", "image_grid_thw", (IMAGE, VIDEO)),
    "audio_tokens": RowLayout("audio_features", "audio_lens", (AUDIO,)),
}


@dataclass(frozen=True)
class HandOff:
    """One edge of the module graph: ``producer`` emits a ``(rows, width)`` tensor that ``consumer``
    takes as keyword argument ``kwarg``.

    ``layout`` (a key of :data:`LAYOUTS`) says how rows are ordered and what the producer reads; the runtime moves the rows, the
    consumer places them. ``grad``: the consumer returns the gradient w.r.t. this tensor and the
    producer backpropagates it. Edges of one (producer, consumer, layout) travel as one payload.
    """

    producer: str
    consumer: str
    kwarg: str
    layout: str
    width: int
    grad: bool = True


@runtime_checkable
class ProducerShard(Protocol):
    """One SP rank's part of a producer's input for one micro-batch (a picklable dataclass).

    ``token_index``: ascending layout rows this rank outputs; ``num_tokens``: layout rows of the whole
    input; ``forward_kwargs()``: the producer module's forward takes exactly these.
    """

    sp_size: int
    token_index: torch.Tensor
    num_tokens: int

    @property
    def num_patches(self) -> int: ...

    def forward_kwargs(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class LLMOutput:
    """What an LLM module returns for one micro-batch.

    ``loss_sum``: fp32 scalar, SUM of the shifted token cross-entropies (labels != -100), plus any
    auxiliary loss the model adds to its training loss, in the same token-sum units (an MoE's
    weighted load-balancing loss). ``num_tokens``: how many label tokens that sum covers. HF's loss ==
    loss_sum / num_tokens. ``aux_losses``: name -> detached scalar, each auxiliary loss UNWEIGHTED as
    transformers reports it (e.g. ``router_aux_loss``, HF's ``aux_loss``), for logging only: its
    weighted part is already in ``loss_sum``. Empty for a dense model.
    """

    loss_sum: torch.Tensor
    num_tokens: int
    aux_losses: Mapping[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class StepStatistics:
    """What a loss module needs to compute its terms defined on a BATCH over the whole step.

    A term defined on a batch (an MoE router's load-balancing loss: a product of two means over the
    batch's tokens) is not a sum over tokens, so splitting the step into micro-batches would change it.
    A loss module that has such terms lists them in ``batch_terms`` (a tuple of names; absent or
    empty: none) and takes two forward keywords:

    - ``batch_statistics=True``: returns, instead of an ``LLMOutput``, the micro-batch's statistics as
      one detached 1-D tensor, summed over the module's token ranks (a collective; the same on every
      rank). They are additive: their sum over the step's micro-batches is the step's.
    - ``step_statistics=StepStatistics(values, num_label_tokens)``: the step's sums (``values``, plain
      floats, never cast by a mixed-precision policy) and label tokens ``T``; the forward's
      ``loss_sum`` then holds this micro-batch's exact part of each term over the step, in token-sum
      units (so ``sum of loss_sum / T`` over micro-batches and ranks is the loss on the step's batch).

    Without ``step_statistics`` such a term is taken over the micro-batch's tokens of every rank.
    """

    values: tuple[float, ...]
    num_label_tokens: int


@runtime_checkable
class ModelFamily(Protocol):
    """A model family as a graph of independently built and loaded modules: what the generic layers
    call (runtime, data, checkpoint, config validation, the loader); nothing else is asked of a family."""

    name: str
    module_names: tuple[str, ...]  # producers before consumers

    def handoffs_for(self, hf_config: PretrainedConfig) -> tuple[HandOff, ...]:
        """The graph's edges for this config (widths from it); the runtime walks these, naming none."""
        ...

    def shard_inputs(
        self,
        name: str,
        hf_config: PretrainedConfig,
        *,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor,
        sp_size: int,
    ) -> list[ProducerShard]:
        """Cut one micro-batch's images for producer ``name`` over ``sp_size`` SP ranks (pure; every
        rank gets a shard, possibly without rows)."""
        ...

    def tokens_per_image(self, hf_config: PretrainedConfig, image_grid_thw: torch.Tensor) -> list[int]:
        """Rows of the ``image_tokens`` layout per image."""
        ...

    def blank_image(self, hf_config: PretrainedConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values, image_grid_thw)`` of the smallest valid image (FSDP replicas without images)."""
        ...

    def token_strings(self) -> dict[str, str]:
        """``SpecialTokens`` field -> token text in the tokenizer (``image_token_id`` -> ``<|image_pad|>``)."""
        ...

    def load_image_processor(self, model_path: str, *, min_pixels: int, max_pixels: int) -> Any:
        """The image processor of ``model_path`` (``merge_size``, ``get_number_of_image_patches``, call)."""
        ...

    def finish_export(self, out_dir: Path) -> None:
        """Make an HF export directory (weights, config and the model's side files already written)
        load with transformers' Auto classes in dhp's own environment, e.g. a processor class that
        needs no torchvision. A no-op where nothing is needed."""
        ...

    def hf_config(self, model_cfg: ModelConfig) -> PretrainedConfig:
        """The transformers config for the schema's architecture numbers, dtype and attention."""
        ...

    def hf_config_from_dir(self, path: str, *, attn_implementation: str = "sdpa") -> PretrainedConfig:
        """The transformers config of a local HF directory (``config.json``), validated for this family."""
        ...

    def tiny_model_config(self) -> ModelConfig:
        """A tiny architecture for tests (seconds on CPU): its ``conf/model/tiny*.yaml`` entry."""
        ...

    def build_module(
        self, name: str, hf_config: PretrainedConfig, *, device: torch.device | str, dtype: torch.dtype
    ) -> nn.Module:
        """Build one module alone. On ``meta`` nothing is allocated; elsewhere it is randomly initialised."""
        ...

    def checkpoint_owner(self, key: str) -> tuple[str, str] | None:
        """Checkpoint key -> ``(module_name, module_fqn)``; None when no module owns it."""
        ...

    def tied_parameters(self, name: str, hf_config: PretrainedConfig) -> dict[str, str]:
        """``{fqn: source_fqn}`` of parameters that share storage and are not read from the checkpoint."""
        ...

    def reference_model(self, hf_config: PretrainedConfig) -> nn.Module:
        """The untouched single-process transformers model (parity, ``dhp verify``)."""
        ...

    def split_state_dict(self, ref_state_dict: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """Cut the reference model's state dict into ``{module_name: {module_fqn: tensor}}``."""
        ...


__all__ = [
    "AttentionSite",
    "HandOff",
    "LLMOutput",
    "ModelFamily",
    "ModuleParallelPlan",
    "RowLayout",
]
