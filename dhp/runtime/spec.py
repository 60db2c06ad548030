"""What one rank actor is built from: its module's configs, mesh, device, channel and the graph's links."""

from __future__ import annotations

from dataclasses import dataclass

from dhp.config.schema import ModelConfig, ModuleConfig, TrainConfig
from dhp.runtime.bridge import BridgeLayout
from dhp.runtime.graph import Link


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a :class:`~dhp.runtime.worker.ModuleWorker` needs besides its name and rank.

    ``mesh``: the group's ordered ``{axis: degree}``; ``handoff``: the plan's resolved channel
    (``object_store`` | ``cuda_ipc`` | ``p2p``); ``links``: the graph's links (the worker uses those
    it produces or consumes); ``bridge_layout``: bridge ranks of every group (``p2p`` only);
    ``loss_chunk_tokens``: the plan's resolved loss chunk (0: the module config's).
    """

    model: ModelConfig
    module: ModuleConfig
    train: TrainConfig
    mesh: dict[str, int]
    device: str
    handoff: str
    links: tuple[Link, ...]
    bridge_layout: BridgeLayout | None = None
    loss_chunk_tokens: int = 0
