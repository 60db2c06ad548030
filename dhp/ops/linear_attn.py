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

Two questions, two functions. :func:`planned_kernel` is the kernel a plan for a device type counts
(memory, time) and therefore needs: ``fla-chunk`` where the packages run (the plan says it needs
flash-linear-attention and causal-conv1d, :data:`KERNEL_PACKAGES`), the torch fallback elsewhere. It
is pure: the plan never depends on what the planning host has installed. :func:`require_kernel` is
the runtime's check at start, on the rank that runs the layer: the kernel this environment would run
must be the planned one, else a PlanError naming the missing packages and the fix (as a missing
flash-attn refuses ``attn_implementation=flash_attention_2``; never a silent fallback).

Torch-free at module level (the planner is torch-free and names the kernel too); only
:func:`linear_attention_kernel` and :func:`require_kernel` import the kernel packages, so call them
where the layer will run.
"""

from __future__ import annotations

import importlib
from functools import cache

from dhp.errors import PlanError

FLA_CHUNK = "fla-chunk"
FLA_CHUNK_TORCH_CONV = "fla-chunk+torch-conv1d"
TORCH_FALLBACK = "torch-fallback"
#: the device types the kernel packages run on (transformers' rule for ``fla`` and ``causal_conv1d``)
KERNEL_DEVICES = ("cuda",)
#: (module, attribute) of each kernel, where transformers' dispatcher imports it from
DELTA_RULE_KERNEL = ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
CONV1D_KERNEL = ("causal_conv1d", "causal_conv1d_fn")
#: the PyPI packages each kernel needs beyond torch and transformers (all in the ``[gpu]`` extra)
KERNEL_PACKAGES: dict[str, tuple[str, ...]] = {
    FLA_CHUNK: ("flash-linear-attention", "causal-conv1d"),
    FLA_CHUNK_TORCH_CONV: ("flash-linear-attention",),
    TORCH_FALLBACK: (),
}


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


def planned_kernel(device_type: str) -> str:
    """The kernel a plan for ``device_type`` counts and needs: ``fla-chunk`` on a device the kernel
    packages run on, ``torch-fallback`` elsewhere. Pure: never imports anything."""
    return FLA_CHUNK if device_type in KERNEL_DEVICES else TORCH_FALLBACK


def require_kernel(device_type: str) -> str:
    """The kernel a Gated DeltaNet layer runs on ``device_type`` here, which must be the planned one
    (:func:`planned_kernel`); PlanError naming the packages that do not import, and the fix."""
    want, have = planned_kernel(device_type), linear_attention_kernel(device_type)
    if have == want:
        return have
    missing = [p for p in KERNEL_PACKAGES[want] if p not in KERNEL_PACKAGES[have]]
    raise PlanError(
        f"the plan runs Gated DeltaNet layers on {device_type} with the {want} kernel, which needs "
        f"{' and '.join(KERNEL_PACKAGES[want])}; {' and '.join(missing)} "
        f"{'does' if len(missing) == 1 else 'do'} not import in this process "
        f"(it would run {have} instead: other memory and time than planned). Fix: pip install 'dhp[gpu]' "
        "on every node (a CUDA build of each package), or plan the run for cluster.device=cpu."
    )


def is_slow_fallback(device_type: str, kernel: str) -> bool:
    """True when a GPU run uses any torch reference op of the layer (a missing GPU extra)."""
    return device_type in KERNEL_DEVICES and kernel != FLA_CHUNK


def kernel_note(device_type: str, kernel: str) -> str:
    """``kernel`` plus what it needs (a planned kernel, plan output), or, for a slow fallback on a GPU,
    what is missing and the fix (logs)."""
    if not is_slow_fallback(device_type, kernel):
        needs = KERNEL_PACKAGES.get(kernel, ())
        return f"{kernel} (needs {' + '.join(needs)}: pip install 'dhp[gpu]')" if needs else kernel
    missing = "causal-conv1d" if kernel == FLA_CHUNK_TORCH_CONV else "flash-linear-attention, causal-conv1d"
    return f"{kernel} (SLOW on {device_type}: {missing} not importable; fix: pip install 'dhp[gpu]')"


__all__ = [
    "CONV1D_KERNEL",
    "DELTA_RULE_KERNEL",
    "FLA_CHUNK",
    "FLA_CHUNK_TORCH_CONV",
    "KERNEL_DEVICES",
    "KERNEL_PACKAGES",
    "TORCH_FALLBACK",
    "is_slow_fallback",
    "kernel_note",
    "linear_attention_kernel",
    "planned_kernel",
    "require_kernel",
]
