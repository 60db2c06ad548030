"""Data parallelism across replicas of an SP/TP group: gradient SUM over ``dp`` and ZeRO-1.

Placement: with mesh (dp, tp) or (dp, sp) each dp replica holds the same parameters (a TP shard or the
full replicated module) and sees different samples. Gradients are SUMMED over dp (never averaged):
every loss is already divided by the step's global label-token count. ZeRO-1 keeps the AdamW states
(2 x fp32 per element) of ~1/dp of the parameters on each rank; after the step each owner broadcasts
its updated parameters (one coalesced broadcast per owner). Gradients stay all-reduced in full on every
rank, so the global grad norm and clipping need no extra communication.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's storage of ``t`` (the local shard of a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _coalesced(tensors: list[torch.Tensor], fn) -> None:
    """Apply the collective ``fn`` to ``tensors`` flattened into one buffer per dtype, then copy back."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        fn(flat)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def allreduce_grads_(params: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    """SUM the (local) gradients of ``params`` over ``group`` in place; a missing grad counts as zeros."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(local(p.grad))
    _coalesced(grads, lambda flat: dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group))


def partition_params(sizes: list[int], parts: int) -> list[int]:
    """Pure: owner rank of each parameter, greedy largest-first onto the least-loaded rank (ties: lowest)."""
    load = [0] * parts
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(parts), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class _Partition:
    """``params`` spread over the ranks of ``group`` by :func:`partition_params` (same on every rank)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
        self.params, self.group = params, group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.owner = partition_params([local(p).numel() for p in params], self.size)

    def owned(self) -> list[nn.Parameter]:
        return [p for p, o in zip(self.params, self.owner, strict=True) if o == self.rank]

    @torch.no_grad()
    def broadcast(self) -> None:
        """Every owner broadcasts its (local shards of its) parameters over the group, coalesced."""
        for owner in range(self.size):
            mine = [local(p) for p, o in zip(self.params, self.owner, strict=True) if o == owner]
            if mine:
                _coalesced(
                    mine, lambda flat, src=owner: dist.broadcast(flat, group=self.group, group_src=src)
                )


class Zero1AdamW(torch.optim.AdamW):
    """AdamW whose states live only on each parameter's owner in the dp group (ZeRO-1).

    It is a plain ``AdamW`` over this rank's owned parameters (so LR schedulers and DCP state dicts work);
    ``step`` updates the owned parameters, then (its first step post-hook) every owner broadcasts its
    parameters to the dp group.
    ``zero_grad`` clears the gradients of all parameters, owned or not. ``unpartitioned``: parameters
    the dp group does not partition (expert-parallel experts: the dp ranks hold different ones). With
    ``expert_group`` (the ``edp`` ranks holding the SAME local expert shards, whose summed grads are
    identical there) they are partitioned over that group instead, by the same greedy rule: each
    rank keeps the AdamW states of ~1/edp of its experts' elements and broadcasts the ones it owns
    over ``expert_group`` after the step. Without it every rank steps its experts itself and keeps
    their states. Every EP rank's experts have the same local shapes, so the owner of a given
    parameter is the same edp index in every EP group: each shard of each expert state lives on
    exactly one rank, which is what a DCP checkpoint of the states needs.
    """

    def __init__(
        self,
        params: list[nn.Parameter] | list[dict],
        *,
        dp_group: dist.ProcessGroup,
        unpartitioned: Sequence[nn.Parameter] = (),
        expert_group: dist.ProcessGroup | None = None,
        **adamw,
    ) -> None:
        # params: a list of parameters, or of param-group dicts (``dhp.parallel.param_groups``): every
        # group is kept on every rank (possibly empty here), holding the parameters this rank owns
        groups = (
            [dict(g) for g in params]
            if params and isinstance(params[0], dict)
            else [{"params": list(params)}]
        )
        mine = {id(p) for p in unpartitioned}
        experts = [p for g in groups for p in g["params"] if id(p) in mine]
        self._all = [p for g in groups for p in g["params"] if id(p) not in mine]
        self._group = dp_group
        self._partitions = [_Partition(self._all, dp_group)]
        if expert_group is not None and dist.get_world_size(expert_group) > 1:
            self._partitions.append(_Partition(experts, expert_group))
            self._own_all: list[nn.Parameter] = []
        else:  # every rank steps its own experts
            self._own_all = experts
        owned = {id(p) for part in self._partitions for p in part.owned()} | {id(p) for p in self._own_all}
        for g in groups:
            g["params"] = [p for p in g["params"] if id(p) in owned]
        super().__init__(groups, **adamw)
        # the broadcast is a step post-hook, not a ``step`` override calling AdamW's: torch wraps the
        # ``step`` of every optimizer class it builds to run the hooks, so an override would run
        # them twice once a plain AdamW exists in the process
        self.register_step_post_hook(lambda opt, args, kwargs: opt._broadcast_owned())

    @torch.no_grad()
    def _broadcast_owned(self) -> None:
        """After AdamW updated this rank's own parameters: every owner broadcasts its parameters to
        its partition's group (dp; edp for the experts), so every replica holds the whole update."""
        for part in self._partitions:
            part.broadcast()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in [p for part in self._partitions for p in part.params] + self._own_all:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
