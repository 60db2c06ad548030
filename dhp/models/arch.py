"""What the planner knows about a model family, without torch: geometry and parameter counts.

A family's ``arch.py`` exposes ``ARCH``, an object with the :class:`FamilyArch` methods. They read
the run's architecture numbers (``model.vision`` / ``model.llm`` of the schema, plus the family's own
keys in their ``extra`` maps) and return plain numbers. ``dhp.plan`` reaches them through
``dhp.plan.params`` (same function names for every family), ``dhp.config.validate`` through
:meth:`FamilyArch.validate`. Nothing here imports torch: the planner stays pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from dhp.config.issues import Issues


@dataclass(frozen=True)
class ParamCount:
    """Parameters of one module: those TP shards and those every TP rank replicates."""

    tp_sharded: int
    replicated: int

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated

    def per_tp_rank(self, tp: int) -> float:
        return self.tp_sharded / tp + self.replicated


@dataclass(frozen=True)
class LayerShape:
    """Sizes that set one transformer layer's activations: hidden, MLP, KV width, heads."""

    hidden: int
    mlp: int
    kv_dim: int  # num_kv_heads * head_dim (== hidden without GQA)
    heads: int
    layers: int
    q_dim: int = 0  # num_heads * head_dim, the q/o projections' width; 0: == hidden
    #: column-parallel projections reading the block's input (q, k, v, gate, up unfused: 5; a fused
    #: qkv: 3; an ungated MLP: one fewer): under TP each one's input grad is all-reduced on its own
    tp_input_grads: int = 5


@dataclass(frozen=True)
class VisionGeometry:
    """The encoder numbers the planner reads (names as in the schema's ``model.vision``).

    Full attention in every block: ``fullatt_block_indexes = tuple(range(depth))`` and ``window_size = 0``.
    """

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    window_size: int
    in_channels: int
    fullatt_block_indexes: tuple[int, ...]


@dataclass(frozen=True)
class LLMGeometry:
    """The language-model numbers the planner reads (names as in the schema's ``model.llm``)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool


@dataclass(frozen=True)
class Geometry:
    """A model's geometry: its encoder (None for a text-only model), its LLM, and the hand-off width
    (columns per image token, summed over every edge into the LLM)."""

    vision: VisionGeometry | None
    llm: LLMGeometry
    handoff_width: int


@dataclass(frozen=True)
class ModuleAxes:
    """Which parallel axes one module of a family supports, and the sizes each degree must divide.

    ``tp``/``sp``: tensor parallelism / Ulysses SP exist for the module; ``tp_divides``/``sp_divides``
    name every size the degree must divide (each rank holds 1/degree of it); ``tp_sequence_parallel``:
    Megatron sequence parallelism inside the TP group exists. ``fsdp`` and ``dp`` apply to any module.
    The plan-validity rule (``dhp.config.plan_space``) reads this; the runtime's
    ``ModuleParallelPlan`` describes the same facts (a test keeps them equal).
    """

    tp: bool
    sp: bool
    tp_sequence_parallel: bool
    tp_divides: Mapping[str, int] = field(default_factory=dict)
    sp_divides: Mapping[str, int] = field(default_factory=dict)


class FamilyArch(Protocol):
    """Architecture numbers -> validation, geometry and parameter counts of one family (pure)."""

    def validate(self, model: DictConfig, issues: Issues) -> None:
        """Add an issue for every architecture number this family cannot build (incl. ``extra`` keys)."""
        ...

    def geometry(self, model: DictConfig) -> Geometry:
        """The numbers the planner reads."""
        ...

    def module_params(self, name: str, model: DictConfig) -> ParamCount:
        """Parameters of module ``name``, split by how TP shards them."""
        ...

    def layer_params(self, name: str, model: DictConfig) -> ParamCount:
        """Parameters of ONE block of module ``name`` (an FSDP unit: all-gathered at once)."""
        ...

    def largest_param(self, name: str, model: DictConfig) -> int:
        """Elements of the module's largest single parameter tensor (before TP/FSDP sharding)."""
        ...

    def layer_shape(self, name: str, model: DictConfig) -> LayerShape:
        """Activation-relevant sizes of one block of module ``name``."""
        ...

    def module_axes(self, name: str, model: DictConfig) -> ModuleAxes:
        """The parallel axes module ``name`` supports and what each degree must divide."""
        ...
