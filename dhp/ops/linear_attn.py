"""Which kernels a Gated DeltaNet (linear attention) layer runs: one function, one name.

The layer's two hot ops are the chunked gated delta rule and the short causal depthwise conv1d.
transformers' layer dispatches each op itself, once per process: it imports the original package
(``fla`` for ``chunk_gated_delta_rule`` at ``fla.ops.gated_delta_rule``, ``causal_conv1d`` for
``causal_conv1d_fn``) and runs it when the inputs are on CUDA; otherwise, or when the import fails, it
runs its own torch reference (correct, much slower: a Python loop over 64-token chunks). That choice
is invisible in a run unless it is named, so :func:`linear_attention_kernel` applies the same rule
(the real import, not a lookup of the package's name) and returns the name that goes into the plan
(``Plan.kernels``) and into every step of ``metrics.jsonl`` (``kernels``):

- ``fla-chunk``: flash-linear-attention's chunked gated delta rule and causal-conv1d's CUDA conv;
- ``fla-chunk+torch-conv1d``: the fla delta rule, causal-conv1d missing (the conv is the torch one);
- ``torch-fallback``: transformers' torch delta rule and conv (every CPU run; on CUDA the GPU extra
  ``pip install 'dhp[gpu]'`` is missing or broken, and :func:`is_slow_fallback` says so).

Torch-free at module level (the planner is torch-free and names the kernel too); a name is computed
by importing the kernel packages, so call it where the layer will run.
"""

from __future__ import annotations

import importlib
from functools import cache

FLA_CHUNK = "fla-chunk"
FLA_CHUNK_TORCH_CONV = "fla-chunk+torch-conv1d"
TORCH_FALLBACK = "torch-fallback"
#: the device types the kernel packages run on (transformers' rule for ``fla`` and ``causal_conv1d``)
KERNEL_DEVICES = ("cuda",)
#: (module, attribute) of each kernel, where transformers' dispatcher imports it from
DELTA_RULE_KERNEL = ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
CONV1D_KERNEL = ("causal_conv1d", "causal_conv1d_fn")


@cache
def _importable(module: str, attr: str) -> bool:
    """True when ``module`` imports and holds ``attr`` (any import error counts as absent, as in
    transformers' dispatcher)."""
    try:
        return getattr(importlib.import_module(module), attr, None) is not None
    except Exception:
        return False


def linear_attention_kernel(device_type: str) -> str:
    """The kernel name a Gated DeltaNet layer runs with on ``device_type`` (``"cuda"``, ``"cpu"``, ...)
    in this Python environment: ``fla-chunk``, ``fla-chunk+torch-conv1d`` or ``torch-fallback``."""
    if device_type not in KERNEL_DEVICES or not _importable(*DELTA_RULE_KERNEL):
        return TORCH_FALLBACK
    return FLA_CHUNK if _importable(*CONV1D_KERNEL) else FLA_CHUNK_TORCH_CONV


def is_slow_fallback(device_type: str, kernel: str) -> bool:
    """True when a GPU run uses any torch reference op of the layer (a missing GPU extra)."""
    return device_type in KERNEL_DEVICES and kernel != FLA_CHUNK


def kernel_note(device_type: str, kernel: str) -> str:
    """``kernel`` plus, for a slow fallback on a GPU, what is missing and the fix (plan output, logs)."""
    if not is_slow_fallback(device_type, kernel):
        return kernel
    missing = "causal-conv1d" if kernel == FLA_CHUNK_TORCH_CONV else "flash-linear-attention, causal-conv1d"
    return f"{kernel} (SLOW on {device_type}: {missing} not importable; fix: pip install 'dhp[gpu]')"


__all__ = [
    "CONV1D_KERNEL",
    "DELTA_RULE_KERNEL",
    "FLA_CHUNK",
    "FLA_CHUNK_TORCH_CONV",
    "KERNEL_DEVICES",
    "TORCH_FALLBACK",
    "is_slow_fallback",
    "kernel_note",
    "linear_attention_kernel",
]
