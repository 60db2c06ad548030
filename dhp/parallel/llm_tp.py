"""Tensor parallelism for the LLM module, as a plan (FQN glob -> DTensor style) plus a vocab-parallel loss.

Placement after :func:`apply_tp` on a TP group of N ranks:
- ``q/k/v_proj``, ``gate/up_proj`` (and their biases): ``Shard(0)`` (column-parallel), each rank holds
  1/N of the heads / intermediate features;
- ``o_proj``, ``down_proj``: ``Shard(1)`` (row-parallel); their output is all-reduced to a replicated
  hidden state;
- ``embed_tokens``: vocab-parallel (``Shard(0)`` of the (V, H) table) by :class:`VocabParallelEmbedding`:
  each rank looks up only its vocab range and the output is all-reduced (replicated); its weight grad
  is the local (V/N, H) shard. (DTensor's ``RowwiseParallel`` on an Embedding was found to leave a
  ``Replicate`` dense (V, H) weight grad on every rank here; at 152K x 8192 that is 5 GB fp32 per rank.)
- ``lm_head``: vocab-parallel (``Shard(0)``), its output stays a local (B, S, V/N) shard, never gathered;
- norms: replicated (their grads are identical on every rank, no reduction needed).

The loss is computed by ``module.loss_fn(logits, labels)``; apply_tp swaps it for
:func:`vocab_parallel_loss_sum`, which runs ``torch.distributed.tensor.parallel.loss_parallel`` on the
local logits shard: per-rank logits memory is B*S*V/N and full logits are never materialised.
Input gradients (to ``inputs_embeds`` and so to the image embeddings) are all-reduced by the DTensor
styles (Colwise input is Replicate), so they are complete and identical on every TP rank.
"""

from __future__ import annotations

import fnmatch
import types
from collections.abc import Mapping
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from dhp.errors import PlanError

IGNORE_INDEX = -100


class _ReduceFromTP(torch.autograd.Function):
    """Forward: SUM the per-rank partial outputs over the TP group; backward: identity (the upstream
    gradient is already replicated, and each rank's partial contributes to the sum with weight 1)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous().clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def _vocab_parallel_embedding_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """Look up the ids of this rank's vocab range in the local (V/N, H) shard; others give 0; all-reduce."""
    weight = self.weight.to_local()
    rows = weight.shape[0]
    start = self._dhp_mesh.get_local_rank() * rows
    outside = (ids < start) | (ids >= start + rows)
    pad = self.padding_idx
    local_pad = pad - start if pad is not None and start <= pad < start + rows else None
    out = F.embedding((ids - start).masked_fill(outside, 0), weight, padding_idx=local_pad)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return _ReduceFromTP.apply(out, self._dhp_mesh.get_group())


class VocabParallelEmbedding(ParallelStyle):
    """Shard an ``nn.Embedding`` table on the vocab dim (``Shard(0)``); replicated input ids, replicated
    output. Unlike ``RowwiseParallel`` on an Embedding, the weight gradient stays a (V/N, H) shard."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise PlanError(f"VocabParallelEmbedding applies to nn.Embedding, got {type(module).__name__}.")

        def shard(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            mod.register_parameter("weight", nn.Parameter(distribute_tensor(mod.weight, mesh, [Shard(0)])))

        distribute_module(module, device_mesh, shard)
        module._dhp_mesh = device_mesh
        module.forward = types.MethodType(_vocab_parallel_embedding_forward, module)
        return module


def llm_tp_plan() -> dict[str, ParallelStyle]:
    """The LLM TP plan: module FQN glob -> DTensor parallel style (globs match one FQN atom per ``*``)."""
    return {
        "language_model.embed_tokens": VocabParallelEmbedding(),
        "language_model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "language_model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "language_model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "language_model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "language_model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "language_model.layers.*.mlp.up_proj": ColwiseParallel(),
        "language_model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=True),
    }


def _glob_match(fqn: str, glob: str) -> bool:
    """True when each dot-separated atom of ``fqn`` matches the same atom of ``glob`` (fnmatch)."""
    a, b = fqn.split("."), glob.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b, strict=True))


def match_plan(module: nn.Module, plan: Mapping[str, object]) -> dict[str, list[str]]:
    """Pure: for every submodule FQN of ``module``, the plan globs that match it (possibly none)."""
    return {fqn: [g for g in plan if _glob_match(fqn, g)] for fqn, _ in module.named_modules() if fqn}


def check_tp_divisibility(
    *, num_heads: int, num_kv_heads: int, vocab_size: int, intermediate_size: int, tp: int
) -> None:
    """Raise PlanError (before any forward) when a TP degree does not divide the sharded dimensions."""
    dims = {
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "vocab_size": vocab_size,
        "intermediate_size": intermediate_size,
    }
    bad = [f"{k}={v}" for k, v in dims.items() if v % tp != 0]
    if bad:
        raise PlanError(
            f"LLM tensor parallelism tp={tp} must divide {', '.join(bad)} (each rank holds 1/tp of them). "
            f"Fix: pick modules.llm.parallel.tp among the common divisors, or use fsdp/dp for the rest."
        )


def shifted_ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Single-device loss: fp32 SUM of next-token CEs; ``labels`` (B, S) unshifted, -100 ignored."""
    flat = logits[:, :-1, :].float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


class _LossParallelSum(torch.autograd.Function):
    """fp32 CE SUM over vocab-sharded logits, forward and backward both under ``loss_parallel``.

    The inner DTensor graph is kept on ``ctx`` so a plain ``loss.backward()`` outside the context (the
    runtime's) still runs the parallel backward; memory: one (tokens, V/N) fp32 shard per rank.
    """

    @staticmethod
    def forward(ctx, local_logits: torch.Tensor, labels: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:  # type: ignore[override]
        with torch.enable_grad():
            leaf = local_logits.detach().requires_grad_(True)
            dt = DTensor.from_local(leaf, mesh, [Shard(1)], run_check=False)
            with loss_parallel():
                loss = F.cross_entropy(dt, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        ctx.leaf, ctx.loss = leaf, loss
        return loss.to_local().detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        with loss_parallel():
            g_out = DTensor.from_local(grad.reshape(()), ctx.loss.device_mesh, [Replicate()], run_check=False)
            ctx.loss.backward(g_out)
        g = ctx.leaf.grad
        ctx.leaf = ctx.loss = None
        return g, None, None


def vocab_parallel_loss_sum(logits: torch.Tensor, labels: torch.Tensor, *, mesh: DeviceMesh) -> torch.Tensor:
    """fp32 SUM of next-token CEs from the local vocab shard (B, S, V/N) of the logits.

    Same contract as :func:`shifted_ce_sum`; the result is the full (replicated) sum on every TP rank.
    """
    flat = logits[:, :-1, :].float().reshape(-1, logits.shape[-1])
    return _LossParallelSum.apply(flat, labels[:, 1:].reshape(-1), mesh)


def _text_config(module: nn.Module):
    lm = getattr(module, "language_model", None)
    if lm is None or not hasattr(module, "lm_head") or not hasattr(module, "loss_fn"):
        raise PlanError(
            f"apply_tp expects the LLM module (attributes language_model, lm_head, loss_fn); got "
            f"{type(module).__name__}. Fix: pass dhp.models' LLMModule."
        )
    return lm.config


def apply_tp(
    module: nn.Module, mesh: DeviceMesh, spec: Mapping[str, ParallelStyle] | None = None
) -> nn.Module:
    """Shard the LLM module in place over the 1-D TP ``mesh`` by ``spec`` (default :func:`llm_tp_plan`).

    Checks divisibility first (PlanError), distributes the matched weights as DTensors (each rank keeps
    1/N of them), swaps ``module.loss_fn`` for the vocab-parallel loss, and re-ties ``lm_head.weight``
    to ``embed_tokens.weight`` when they were tied (both ``Shard(0)`` of the one (V, H) table).
    """
    cfg = _text_config(module)
    tp = mesh.size()
    check_tp_divisibility(
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        vocab_size=cfg.vocab_size,
        intermediate_size=cfg.intermediate_size,
        tp=tp,
    )
    tied = module.lm_head.weight is module.language_model.embed_tokens.weight
    parallelize_module(module, mesh, dict(spec) if spec is not None else llm_tp_plan())
    if tied:  # both styles shard the (V, H) table as Shard(0): share the one DTensor parameter again
        module.lm_head.weight = module.language_model.embed_tokens.weight
    module.loss_fn = partial(vocab_parallel_loss_sum, mesh=mesh)
    return module
