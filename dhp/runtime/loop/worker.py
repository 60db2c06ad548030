"""ModuleWorker: one rank of one module of the graph (a producer such as the vision encoder, or the
consumer that computes the loss, the LLM) inside its actor group.

Placement and memory per rank: the module's shard after ``dhp.parallel.parallelize`` (TP: 1/tp of
the LLM's matrices; SP: a full encoder copy with 1/sp of the activations), its gradients and
optimizer state (none when ``freeze``), and the activations of at most two micro-batches in
flight (the encoder runs micro-batch i+1 while the LLM works on i). Every public method declares
its dispatch/collect contract; the driver (``dhp.runtime.loop.driver``) is the only caller.
"""

from __future__ import annotations

from typing import Any

import torch

from dhp import parallel as par
from dhp.metrics import accounting
from dhp.metrics.memory import peak_memory_bytes, reset_peak_memory
from dhp.runtime.actors.base_worker import DistWorker
from dhp.runtime.actors.dispatch import Collect, Dispatch, register
from dhp.runtime.actors.spec import WorkerSpec
from dhp.runtime.handoff.routing import ProducerWork
from dhp.runtime.handoff.transport import make_transport
from dhp.runtime.loop.eval_worker import EvalMethods
from dhp.runtime.loop.worker_build import BuildMethods
from dhp.runtime.loop.worker_checkpoint import CheckpointMethods
from dhp.runtime.loop.worker_handoff import HandoffMethods
from dhp.runtime.loop.worker_pipeline import PipelineMethods
from dhp.runtime.loop.worker_step import StepMethods


class ModuleWorker(
    BuildMethods, StepMethods, PipelineMethods, HandoffMethods, CheckpointMethods, EvalMethods, DistWorker
):
    """Build, run and update one module's shard on this rank (see module docstring), composed by
    concern: build and load (:class:`~dhp.runtime.loop.worker_build.BuildMethods`), the step
    (:class:`~dhp.runtime.loop.worker_step.StepMethods`, the hand-off's receiving side
    :class:`~dhp.runtime.loop.worker_handoff.HandoffMethods`), checkpoints
    (:class:`~dhp.runtime.loop.worker_checkpoint.CheckpointMethods`), forward-only evaluation
    (:class:`~dhp.runtime.loop.eval_worker.EvalMethods`); the observation methods are its own."""

    def __init__(self, *, module_name: str, rank: int, world_size: int, spec: WorkerSpec) -> None:
        super().__init__(module_name=module_name, rank=rank, world_size=world_size)
        self.spec = spec
        self.model_cfg, self.module_cfg, self.train_cfg = spec.model, spec.module, spec.train
        self.layout = spec.layout  # every degree of this group: the plan's, the one source on the rank
        self.device_type = spec.device
        self.channel = make_transport(
            spec.handoff, bridge_layout=spec.bridge_layout, module=module_name, rank=rank
        )
        self.links_out = tuple(link for link in spec.links if link.producer == module_name)
        self.links_in = tuple(link for link in spec.links if link.consumer == module_name)
        self.frozen = spec.module.freeze
        # the plan's resolved loss chunk (the config's value, or the planner's choice when it is 0)
        self.loss_chunk_tokens = spec.loss_chunk_tokens or spec.module.loss_chunk_tokens
        self._inflight: dict[int, tuple[dict[str, torch.Tensor], ProducerWork]] = {}
        self._step_sums: torch.Tensor | None = None  # this step's batch statistics (statistics_pass), float64
        # handoff_bytes: hand-off bytes this rank copied out of the channel (consumer ranks)
        self._timers = {"fwd_s": 0.0, "bwd_s": 0.0, "step_s": 0.0, "wait_s": 0.0, "handoff_bytes": 0.0}
        self._events: list[tuple[str, int, float, float]] = []  # (method, micro-batch, start, end) wall clock
        self._acct = accounting.from_env(lambda: self.module, lambda: self.optimizer)  # opt-in

    # ---- observation -----------------------------------------------------------------------
    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def take_stats(self) -> dict[str, Any]:
        """This rank's timers and peak memory since the last call; resets both. ``expert_load``: the
        step's tokens per expert over the group's MoE layers (``dhp.parallel.expert_load``; one
        all-reduce over the group), None for a module without MoE blocks."""
        stats = dict(self._timers) | {
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "optim_state_bytes": _optim_state_bytes(self.optimizer),
            "expert_load": _take_expert_load(self.expert_load, self.device),  # collective
            "events": list(self._events),
            "kernels": self.kernels,  # what this process runs (e.g. a linear-attention torch fallback)
        }
        self._events.clear()
        accounting.flush(self._acct, module_name=self.module_name, rank=self.rank)
        self._timers = dict.fromkeys(self._timers, 0.0)
        reset_peak_memory(self.device)
        return stats

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def full_grads(self) -> dict[str, torch.Tensor]:
        """``{fqn: full fp32 CPU grad}`` (collective; verify/parity only, tiny models; under pipeline
        parallelism every stage's, merged on the first)."""
        return par.over_pipeline(par.full_grad_dict(self.module), self.mesh)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``{fqn: full fp32 CPU parameter}`` (collective; verify/parity only, tiny models; under
        pipeline parallelism every stage's, merged on the first)."""
        return par.over_pipeline(par.full_param_dict(self.module), self.mesh)


def _take_expert_load(load: par.ExpertLoad | None, device: torch.device) -> dict[str, Any] | None:
    """The step's expert-load summary for ``metrics.jsonl`` (collective over the group), or None."""
    summary = None if load is None else load.take(device=device)
    return None if summary is None else summary.as_record()


def _optim_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of this rank's optimizer state tensors (local shards); 0 without an optimizer."""
    if optimizer is None:
        return 0
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                local = v.to_local() if hasattr(v, "to_local") else v
                total += local.numel() * local.element_size()
    return total
