"""Parameter counts and layer sizes of a run's modules, from the model's family (``model.family``).

The numbers come from the family's pure ``arch.py`` (:class:`dhp.models.arch.FamilyArch`), so the
planner knows no model family; this module reads them off the typed architecture with the names the
planner uses.
"""

from __future__ import annotations

import weakref

from omegaconf import DictConfig, OmegaConf

from dhp.models.arch import Architecture, LayerShape, ModuleArch, ParamCount
from dhp.models.registry import get_arch

__all__ = [
    "Architecture",
    "LayerShape",
    "ModuleArch",
    "ParamCount",
    "architecture",
    "largest_param",
    "layer_params",
    "layer_shape",
    "module_params",
    "video_frames_per_row",
]


#: id(model config) -> (a weak reference to it, its architecture): read-only configs only
_ARCHS: dict[int, tuple[weakref.ref, Architecture]] = {}


def architecture(model: DictConfig) -> Architecture:
    """The family's typed architecture of ``model``: what the planner's memory, FLOPs and time read.

    A read-only model config (a validated run config's, which the planner never writes) is read once
    per config object: ``--auto`` asks for it per candidate (about 50,000 times for a 30B MoE recipe
    on one node, each a walk over the OmegaConf tree). A writable config is read every time; the
    architecture itself is frozen, so sharing it is safe."""
    if not OmegaConf.is_readonly(model):
        return get_arch(model.family).architecture(model)
    key = id(model)
    hit = _ARCHS.get(key)
    if hit is not None and hit[0]() is model:
        return hit[1]
    arch = get_arch(model.family).architecture(model)
    _ARCHS[key] = (weakref.ref(model, lambda _, k=key: _ARCHS.pop(k, None)), arch)
    return arch


def video_frames_per_row(model: DictConfig) -> int:
    """Video frames the model's pixel-input module folds into one input row (its declared
    ``temporal_patch``; 1 for a model without one)."""
    pixel = [m for m in architecture(model).modules.values() if m.input_row]
    return pixel[0].temporal_patch if pixel else 1


def module_params(name: str, model: DictConfig) -> ParamCount:
    """Parameter count of module ``name`` of ``model``."""
    return architecture(model).modules[name].params


def layer_params(name: str, model: DictConfig) -> ParamCount:
    """Parameters of ONE transformer block of module ``name`` (an FSDP unit: all-gathered at once)."""
    return architecture(model).modules[name].block_params


def largest_param(name: str, model: DictConfig) -> int:
    """Elements of the module's largest single parameter tensor (before TP/FSDP sharding)."""
    return architecture(model).modules[name].largest_param


def layer_shape(name: str, model: DictConfig) -> LayerShape:
    """Activation-relevant sizes of one block of module ``name``."""
    return architecture(model).modules[name].layer_shape()
