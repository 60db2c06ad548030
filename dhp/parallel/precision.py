"""Mixed precision per module: what ``modules.<name>.mixed_precision`` stores, computes and reduces in.

    policy            parameters  gradients  AdamW states  compute, hand-off rows  FSDP reduce-scatter
    fp32              fp32        fp32       fp32          fp32                    fp32
    bf16_master_fp32  fp32        fp32       fp32          bf16                    fp32
    bf16              bf16        bf16       bf16          bf16                    bf16

Storage: the worker builds the module's parameters in :attr:`Precision.param_dtype` whatever
``model.dtype`` the weights come in (a bf16 checkpoint is upcast to fp32 master weights when it is
loaded, ``dhp.models.loading``); torch's AdamW allocates its two states like the parameter, and
autograd accumulates every gradient into ``param.grad`` in the parameter's dtype (over the
micro-batches of a step too), so gradients and states follow the parameters. Buffers (the rotary
``inv_freq``) keep the dtype the family gives them.

Compute under ``bf16_master_fp32`` has one meaning in every plan, FSDP2's ``MixedPrecisionPolicy``:
a unit's parameters are cast to bf16 when the unit's forward starts, and the unit computes with
those bf16 copies exactly as a module with bf16 parameters would (the same ops, the same dtypes,
transformers' own fp32 upcasts inside norms and the fp32 loss included). The units are the family's
repeated blocks (``ModuleParallelPlan.blocks``) and the rest of the module (the root).

- fsdp > 1: FSDP2 does it (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``,
  :mod:`dhp.parallel.fsdp`): each unit all-gathers its fp32 shards as bf16; the bf16 gradients of a
  unit are reduce-scattered in fp32 into the fp32 sharded gradients. Expert-parallel parameters,
  which FSDP leaves alone, are cast by the expert MLP itself (:mod:`dhp.parallel.ep`).
- fsdp == 1 (DP, ZeRO-1, TP, Ulysses SP, EP): :func:`apply_compute_cast` installs the same cast on
  the same units with forward hooks: the pre-hook swaps each fp32 parameter for its bf16 cast (a
  differentiable ``Tensor.to``, so the gradient flows back through the cast and is accumulated in
  fp32 in the parameter's ``.grad``), the post-hook puts the parameter back. Under activation
  checkpointing the hooks run inside the checkpointed block, so its recompute casts again.

Memory of the cast (fsdp == 1): the bf16 copy of a unit's parameters (2 B per parameter) lives
while the unit runs; the ops save the copies they need for backward (a Linear its weight), so
without AC a block's copies stay until its backward, with AC they are dropped at the block's end
and cast again in its recompute; the root's copies (embedding, lm_head, patch embedding, merger)
live through the module's forward and its loss. ``dhp.plan.memory`` counts them
(``compute_weights``).

Why not ``torch.autocast``: autocast casts per op and keeps everything outside its op list in the
parameters' dtype, so over fp32 parameters the LLM's residual stream, its norms and rotary tables stay
fp32, every column-parallel Linear casts the same fp32 input again (q, k, v, gate, up: five bf16
copies of each norm output per block), the MoE dispatch and the sequence-parallel all-gathers move
fp32 rows, its op lists differ between CPU and CUDA (layer_norm and softmax), and it overrides the fp32
matmuls transformers writes on purpose (the torch delta rule). The unit cast gives the compute of the
bf16 policy and of FSDP2, on every device.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from dhp.errors import ConfigError, ConfigIssue, PlanError


@dataclass(frozen=True)
class Precision:
    """The dtypes of one ``mixed_precision`` policy (module docstring)."""

    name: str
    param_dtype: torch.dtype  # parameters, gradients, AdamW states
    compute_dtype: torch.dtype  # matmuls, activations, the rows a module hands to the next
    reduce_dtype: torch.dtype  # FSDP2's gradient reduce-scatter

    @property
    def casts(self) -> bool:
        """The parameters are stored in another dtype than the module computes in (master weights)."""
        return self.param_dtype != self.compute_dtype


#: one entry per ``dhp.config.constants.MIXED_PRECISIONS`` name
PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", torch.float32, torch.float32, torch.float32),
    "bf16_master_fp32": Precision("bf16_master_fp32", torch.float32, torch.bfloat16, torch.float32),
    "bf16": Precision("bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16),
}


def precision_of(name: str) -> Precision:
    """The policy of a ``mixed_precision`` config value; PlanError names the valid ones."""
    if name not in PRECISIONS:
        raise PlanError(
            f"mixed_precision={name!r} is not one of {sorted(PRECISIONS)}. Fix: pick one of them."
        )
    return PRECISIONS[name]


def cast_parameters_(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Store every floating-point parameter of ``module`` in ``dtype``, in place (the same Parameter
    objects, so hooks and tied references survive); buffers are left as they are. Free on ``meta``."""
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    return module


def check_parameter_dtypes(module: nn.Module, precision: Precision, *, module_name: str) -> None:
    """PlanError unless every floating-point parameter is stored in the policy's parameter dtype (the
    worker builds it so; a module built in another dtype would silently train in that one)."""
    params = module.named_parameters()
    wrong = sorted(
        f"{fqn}: {p.dtype}" for fqn, p in params if p.is_floating_point() and p.dtype != precision.param_dtype
    )
    if wrong:
        raise PlanError(
            f"module {module_name!r}: mixed_precision={precision.name} stores parameters in "
            f"{precision.param_dtype}, but {len(wrong)} are not: {wrong[:3]}. Fix: build the module "
            f"in {precision.param_dtype} (dhp.parallel.precision.cast_parameters_)."
        )


def check_device_computes(precision: Precision, device: torch.device, *, module_name: str) -> None:
    """ConfigError when ``device`` cannot compute in the policy's dtype: bf16 on a GPU before compute
    capability 8.0 (checked on the rank, where the GPU is known); CPU torch computes bf16 everywhere."""
    if precision.compute_dtype != torch.bfloat16 or device.type != "cuda":
        return
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        path = f"modules.{module_name}.mixed_precision"
        raise ConfigError(
            [
                ConfigIssue(
                    path,
                    precision.name,
                    "bf16 compute needs a GPU with native bf16 (compute capability >= 8.0); this rank "
                    f"has {torch.cuda.get_device_name(device)}",
                    f"set {path}=fp32",
                )
            ]
        )


Slot = tuple[nn.Module, str]  # (the submodule holding a parameter, its attribute name)


class _UnitCast:
    """Forward hooks of one unit: swap its parameters for ``dtype`` casts while it runs."""

    def __init__(self, slots: list[Slot], dtype: torch.dtype) -> None:
        self.slots, self.dtype = slots, dtype
        self._held: list[list[torch.Tensor]] = []  # a stack: one entry per running forward of the unit

    def pre(self, module: nn.Module, args: Any) -> None:
        originals = [sub._parameters[name] for sub, name in self.slots]
        casts: dict[int, torch.Tensor] = {}  # one copy per parameter (a tied one sits in two slots)
        for (sub, name), p in zip(self.slots, originals, strict=True):
            if id(p) not in casts:
                casts[id(p)] = p.to(self.dtype)
            sub._parameters[name] = casts[id(p)]  # what FSDP2 does with its unsharded parameter
        self._held.append(originals)

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        originals = self._held.pop()
        for (sub, name), p in zip(self.slots, originals, strict=True):
            sub._parameters[name] = p


def _unit_slots(units: list[nn.Module]) -> list[list[Slot]]:
    """Per unit, the (submodule, name) of every floating parameter it owns: those under it and under
    no unit nested inside it (a parameter belongs to its innermost unit, as under FSDP2)."""
    inner: dict[int, int] = {}
    for i, unit in enumerate(units):  # outer units first, so an inner one overrides
        for sub in unit.modules():
            inner[id(sub)] = i
    fsdp_owned = {id(s) for m in units[0].modules() if isinstance(m, FSDPModule) for s in m.modules()}
    slots: list[list[Slot]] = [[] for _ in units]
    for i, unit in enumerate(units):
        for sub in unit.modules():
            if inner[id(sub)] != i or id(sub) in fsdp_owned:  # an FSDP unit casts through its policy
                continue
            for name, p in sub._parameters.items():
                if p is not None and p.is_floating_point():
                    slots[i].append((sub, name))
    return slots


def apply_compute_cast(
    module: nn.Module, blocks: Iterable[nn.Module], *, dtype: torch.dtype
) -> list[RemovableHandle]:
    """Compute ``module`` in ``dtype`` from parameters stored in another dtype (fsdp == 1; module
    docstring): each of ``blocks`` and ``module`` itself (the root: every parameter outside the
    blocks) casts its parameters as its forward starts and restores them as it ends (also when the
    forward raises). Returns the hook handles."""
    units = [module, *blocks]
    handles: list[RemovableHandle] = []
    for unit, slots in zip(units, _unit_slots(units), strict=True):
        if not slots:
            continue
        cast = _UnitCast(slots, dtype)
        handles.append(unit.register_forward_pre_hook(cast.pre))
        handles.append(unit.register_forward_hook(cast.post, always_call=True))
    return handles


__all__ = [
    "PRECISIONS",
    "Precision",
    "apply_compute_cast",
    "cast_parameters_",
    "check_device_computes",
    "check_parameter_dtypes",
    "precision_of",
]
