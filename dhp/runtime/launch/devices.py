"""Which CUDA device an actor uses, with every GPU of its node visible to it.

Ray normally narrows each actor's ``CUDA_VISIBLE_DEVICES`` to its own GPU, so every actor calls
its GPU ``cuda:0``. That breaks the collocated CUDA IPC hand-off: a vision rank's rows live on its
GPU, and an LLM rank on *another* GPU of the node (its TP peers) must open them, which CUDA allows
only for a device the process can see. dhp therefore starts its actors with
``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` (every actor sees the node's GPUs under one
numbering) and each actor selects the GPU Ray assigned it. Memory: an actor creates a CUDA
context only on its own device (``torch.cuda.set_device`` before any other CUDA call); a
cross-GPU IPC read copies the rows over NVLink into the reader's device.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import ray

from dhp.errors import RuntimeFailure

#: set in every actor's environment (see module docstring)
NOSET_VISIBLE = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def local_cuda_index(gpu_ids: Sequence[int | str], visible: str | None) -> int:
    """The torch index of the first GPU Ray assigned (``ray.get_gpu_ids()``) in this process.

    Ray's ids are the node's ids, i.e. entries of the node's ``CUDA_VISIBLE_DEVICES`` when it
    was set (torch then numbers them 0..n-1 in that order), else physical indices.
    """
    if not gpu_ids:
        raise RuntimeFailure(
            "this rank was placed without a GPU (ray.get_gpu_ids() is empty) but the plan is on cuda. "
            "Fix: check that the plan's bundles request GPUs (cluster.device=cuda) and the Ray cluster has them."
        )
    first = str(gpu_ids[0]).strip()
    if visible is None or not visible.strip():
        return int(first)
    order = [v.strip() for v in visible.split(",") if v.strip()]
    if first not in order:
        raise RuntimeFailure(
            f"Ray assigned GPU {first!r} but CUDA_VISIBLE_DEVICES={visible!r} does not list it. "
            "Fix: start Ray with the same CUDA_VISIBLE_DEVICES as the workers."
        )
    return order.index(first)


def assigned_cuda_index() -> int:
    """This actor's CUDA device index (inside a Ray actor started with :data:`NOSET_VISIBLE`)."""

    return local_cuda_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
