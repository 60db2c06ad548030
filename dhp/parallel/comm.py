"""CommCounter: bytes each rank hands to collectives, per collective type, per step, per module.

It is a ``TorchDispatchMode``: every collective reaches the dispatcher as a ``c10d.*`` op (eager
``torch.distributed`` calls, FSDP2's all-gather/reduce-scatter, DDP-style all-reduces, Ulysses'
all-to-all) or a ``_c10d_functional.*`` op (DTensor redistributions in TP and loss_parallel), so one
mode sees them all, in forward and in backward, without patching ``torch.distributed``.

What it counts, per call on this rank (``payload`` bytes, the tensor sizes given to the collective):
- ``all_reduce``: the tensor; ``broadcast``: the tensor (counted on every rank, sender or not);
- ``all_gather``: this rank's input shard; ``reduce_scatter``: this rank's full input;
- ``all_to_all``: this rank's input; ``send``/``recv``: the tensor; ``barrier``: 0.

``wire`` bytes estimate what a bandwidth-optimal ring sends per rank: all_reduce 2(n-1)/n * S,
all_gather (n-1) * S_shard, reduce_scatter (n-1)/n * S_in, all_to_all (n-1)/n * S_in, broadcast S.
Device-to-host copies and Ray hand-offs are not collectives and are not counted here.

Cost: while active, every aten op of the rank passes through one Python check (a few microseconds
each), so time steps without the counter, or count on dedicated steps, when timing matters.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# op name (namespace dropped) -> (collective kind, index of the argument holding this rank's input)
_OPS: dict[str, tuple[str, int]] = {
    # eager c10d ops (torch.distributed.*, FSDP2, DDP-style reductions, Ulysses all-to-all)
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 1),
    "_allgather_base_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_": ("all_to_all", 1),
    "alltoall_base_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0),
    "scatter_": ("scatter", 1),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "barrier": ("barrier", -1),
    # functional ops (DTensor redistribution: TP, loss_parallel)
    "all_reduce": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_into_tensor_coalesced": ("all_gather", 0),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "all_to_all_single": ("all_to_all", 0),
    "broadcast": ("broadcast", 0),
}

_RING = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: float(n - 1),
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "scatter": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
    "barrier": lambda n: 0.0,
}


def _tensors(arg: object) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for a in arg for t in _tensors(a)]
    return []


def _group_size(args: tuple) -> int:
    """Size of the process group the op runs on (ScriptObject group, or functional group name)."""
    for a in args:
        if type(a).__name__ == "ScriptObject":
            return dist.ProcessGroup.unbox(a).size()
    for a in reversed(args):
        if isinstance(a, str):
            return dist.distributed_c10d._resolve_process_group(a).size()
    return dist.get_world_size()


@dataclass
class CommStats:
    """Counts and bytes of one collective type over one step."""

    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0


class CommCounter(TorchDispatchMode):
    """Counts collectives issued inside ``with counter:`` on this rank; ``step()`` reads and resets.

    Usage (one per module worker)::

        counter = CommCounter("llm")
        with counter:
            loss = model(...); loss.backward(); finalize_grads(...)
        stats = counter.step()   # {"llm/all_reduce": CommStats(...), ...}

    ``wire`` bytes use the size of the process group each op ran on.
    """

    def __init__(self, module_name: str) -> None:
        super().__init__()
        self.module_name = module_name
        self._stats: dict[str, CommStats] = defaultdict(CommStats)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if getattr(func, "namespace", "") in ("c10d", "_c10d_functional"):
            entry = _OPS.get(func.__name__.split(".")[0])
            if entry is not None:
                self._record(entry, args)
        return func(*args, **kwargs)

    def _record(self, entry: tuple[str, int], args: tuple) -> None:
        kind, index = entry
        nbytes = 0 if index < 0 else sum(t.numel() * t.element_size() for t in _tensors(args[index]))
        st = self._stats[kind]
        st.calls += 1
        st.payload_bytes += nbytes
        st.wire_bytes += nbytes * _RING[kind](max(_group_size(args), 1))

    def step(self) -> dict[str, CommStats]:
        """This step's stats keyed ``"<module>/<collective>"``; resets the counters."""
        out = {f"{self.module_name}/{k}": v for k, v in sorted(self._stats.items())}
        self._stats = defaultdict(CommStats)
        return out


def comm_metrics(stats: dict[str, CommStats]) -> dict[str, float]:
    """Flatten :meth:`CommCounter.step` output for a metrics record: ``"comm/<module>/<kind>/<field>"``."""
    out: dict[str, float] = {}
    for key, st in stats.items():
        out[f"comm/{key}/calls"] = st.calls
        out[f"comm/{key}/payload_bytes"] = st.payload_bytes
        out[f"comm/{key}/wire_bytes"] = st.wire_bytes
    return out
