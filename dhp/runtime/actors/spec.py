"""What one rank actor is built from: its module's configs, layout, device, channel and the graph's links."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dhp.layout import ParallelLayout
from dhp.runtime.handoff.bridge import BridgeLayout
from dhp.runtime.handoff.graph import Link


def without_degrees(module: Any) -> DictConfig:
    """A read-only copy of a ``modules.<name>`` config node without its ``parallel`` node: what a worker
    gets beside the plan's layout, so the degrees have one source on the rank (the layout)."""
    keys = [k for k in module if k != "parallel"]
    out = OmegaConf.masked_copy(module, keys)
    OmegaConf.set_readonly(out, True)
    return out


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a :class:`~dhp.runtime.loop.worker.ModuleWorker` needs besides its name and rank.

    ``module``: the module's config without its degrees (:func:`without_degrees`); ``layout``: the
    plan's :class:`~dhp.layout.ParallelLayout` of the group, the one source of every degree, from
    which the worker cuts its meshes; ``handoff``: the plan's resolved channel
    (``object_store`` | ``cuda_ipc`` | ``p2p``); ``links``: the graph's links (the worker uses those
    it produces or consumes); ``bridge_layout``: bridge ranks of every group (``p2p`` only);
    ``loss_chunk_tokens``: the plan's resolved loss chunk (0: the module config's).
    """

    model: Any  # ModelConfig
    module: DictConfig  # ModuleConfig without `parallel`
    train: Any  # TrainConfig
    layout: ParallelLayout
    device: str
    handoff: str
    links: tuple[Link, ...]
    bridge_layout: BridgeLayout | None = None
    loss_chunk_tokens: int = 0
