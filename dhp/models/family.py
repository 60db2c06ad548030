"""The model-family protocol: a model as a graph of modules that run in different processes.

A family names its modules (each becomes one actor group with its own world and parallelism), the
hand-offs between them (what tensor flows from which producer to which consumer), and how each
module is built alone (meta device first) and fed its own checkpoint tensors. Nothing here knows
about parallelism: ``dhp/parallel`` wraps the modules a family builds.

Shape of a family (see :class:`ModelFamily`):

- graph: ``module_names`` (producers first) and ``handoffs`` (``HandOff(producer, consumer,
  kwarg, layout)``); the consumer takes the tensor as a keyword argument and its backward yields
  the gradient the producer backpropagates;
- configs: ``hf_config(model_cfg)`` from the schema, ``hf_config_from_dir(path)`` from a HF
  directory, ``tiny_model_config()`` for tests, ``modules_for(hf_config)``;
- modules: ``build_module(name, hf_config, device=, dtype=)`` (meta allocates nothing),
  ``init_buffers`` (non-persistent buffers after ``to_empty``), ``tied_parameters`` / ``tie``;
- checkpoint: ``checkpoint_owner(key) -> (module, fqn)``; ``dhp.models.loading`` does the rest
  (only this module's keys are read, missing/unexpected keys are listed);
- reference: ``reference_model(hf_config)`` and ``split_state_dict`` for parity.

A second family (say LLaVA-OneVision) is one more class with these members, registered with
:func:`register_family`; its modules wrap the transformers classes as ``VisionModule`` /
``LLMModule`` do. An audio encoder is one more module name (``audio``) and one more hand-off
(``HandOff("audio", "llm", "audio_embeds", ...)``); the LLM module takes ``audio_embeds`` and
places them at its audio-token positions. The runtime walks ``module_names`` and ``handoffs``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

from dhp.errors import ConfigError, ConfigIssue

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from dhp.config.schema import ModelConfig


@dataclass(frozen=True)
class HandOff:
    """One edge of the module graph: ``producer`` emits ``tensor``, ``consumer`` takes it as ``kwarg``.

    ``layout`` says how rows are ordered and where the consumer places them (the runtime moves the
    rows; the consumer places them). The backward edge is implied: the consumer returns the
    gradient w.r.t. this tensor and the producer backpropagates it.
    """

    producer: str
    consumer: str
    kwarg: str
    layout: str


@dataclass(frozen=True)
class LLMOutput:
    """What an LLM module returns for one micro-batch.

    ``loss_sum``: fp32 scalar, SUM of the shifted token cross-entropies (labels != -100).
    ``num_tokens``: how many label tokens that sum covers. HF's mean loss == loss_sum / num_tokens.
    """

    loss_sum: torch.Tensor
    num_tokens: int


@runtime_checkable
class ModelFamily(Protocol):
    """A model family as a graph of independently built and loaded modules."""

    name: str
    module_names: tuple[str, ...]  # producers before consumers
    handoffs: tuple[HandOff, ...]

    def hf_config(self, model_cfg: ModelConfig) -> PretrainedConfig:
        """The transformers config for the schema's architecture numbers, dtype and attention."""
        ...

    def hf_config_from_dir(self, path: str, *, attn_implementation: str = "sdpa") -> PretrainedConfig:
        """The transformers config of a local HF directory (``config.json``), validated for this family."""
        ...

    def tiny_model_config(self) -> ModelConfig:
        """A tiny architecture for tests (seconds on CPU); agrees with ``conf/model/tiny.yaml``."""
        ...

    def build_module(
        self, name: str, hf_config: PretrainedConfig, *, device: torch.device | str, dtype: torch.dtype
    ) -> nn.Module:
        """Build one module alone. On ``meta`` nothing is allocated; elsewhere it is randomly initialised."""
        ...

    def init_buffers(self, name: str, module: nn.Module) -> None:
        """Recompute the module's non-persistent buffers in place (after ``to_empty`` from meta)."""
        ...

    def modules_for(self, hf_config: PretrainedConfig) -> tuple[str, ...]:
        """The modules a given config has (e.g. only ``llm`` for a text-only config)."""
        ...

    def checkpoint_owner(self, key: str) -> tuple[str, str] | None:
        """Checkpoint key -> ``(module_name, module_fqn)``; None when no module owns it."""
        ...

    def tie(self, name: str, module: nn.Module, hf_config: PretrainedConfig) -> None:
        """Re-share tied parameters (after building or ``to_empty``)."""
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


_REGISTRY: dict[str, Callable[[], ModelFamily]] = {}


def register_family(name: str, factory: Callable[[], ModelFamily]) -> None:
    """Make ``get_family(name)`` return ``factory()``."""
    _REGISTRY[name] = factory


def family_names() -> Iterable[str]:
    """Registered family names, sorted."""
    return sorted(_REGISTRY)


def get_family(name: str) -> ModelFamily:
    """The registered family ``name``; a ConfigError lists the known ones otherwise."""
    if name not in _REGISTRY:
        raise ConfigError(
            [
                ConfigIssue(
                    path="model.family",
                    value=name,
                    rule=f"unknown model family; known: {', '.join(family_names())}",
                    fix="set model.family to one of the known families",
                )
            ]
        )
    return _REGISTRY[name]()
