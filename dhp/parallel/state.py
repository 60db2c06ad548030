"""Model/optimizer state across placements: full tensors for parity/verify, and live model-state bytes.

DCP save/load (``get_state_dict``/``set_state_dict``, resharding across TP/FSDP/ZeRO-1) lives in
``dhp.checkpoint.module_state``; it works on the modules and optimizers built here unchanged.

Every function here that touches a DTensor (TP shards, FSDP2 shards) is a collective over the module's
group: call it on every rank, in the same order. Full tensors are materialised in host memory only for
the one tensor being gathered plus the returned dict, so use :func:`full_grad_dict` and
:func:`full_state_dict` for tiny models, parity tests and verify, never at production scale.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer


def _full(t: torch.Tensor) -> torch.Tensor:
    """The full logical tensor as a plain fp32 CPU copy (collective when ``t`` is a DTensor)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to(device="cpu", dtype=torch.float32).clone()


def full_grad_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """{param FQN: full fp32 CPU gradient} for every parameter that has a gradient (collective)."""
    return {name: _full(p.grad) for name, p in module.named_parameters() if p.grad is not None}


def full_param_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """{param FQN: full fp32 CPU parameter} for every parameter (collective)."""
    return {name: _full(p) for name, p in module.named_parameters()}


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def model_state_bytes(module: nn.Module, optimizer: Optimizer | None = None) -> dict[str, int]:
    """Live bytes THIS rank holds for model states: parameters, gradients, optimizer states (local shards).

    Counts tensor storage only (not allocator caches or RSS); a tensor shared by two parameters counts once.
    """
    seen: set[int] = set()
    out = {"params": 0, "grads": 0, "optimizer": 0}

    def add(key: str, t: torch.Tensor) -> None:
        if id(t) not in seen:
            seen.add(id(t))
            out[key] += _local_bytes(t)

    for p in module.parameters():
        add("params", p)
        if p.grad is not None:
            add("grads", p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    add("optimizer", v)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
