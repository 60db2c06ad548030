"""Tensor parallelism for the LLM module, as a plan (FQN glob -> DTensor style), optional Megatron-style
sequence parallelism inside the TP group, and the vocab-parallel chunked loss.

Placement after :func:`apply_tp` on a TP group of N ranks:
- ``q/k/v_proj``, ``gate/up_proj`` (and their biases): ``Shard(0)`` (column-parallel), each rank holds
  1/N of the heads / intermediate features;
- ``o_proj``, ``down_proj``: ``Shard(1)`` (row-parallel); without SP their output is all-reduced to a
  replicated hidden state, with SP it is reduce-scattered into sequence shards;
- ``embed_tokens``: vocab-parallel (``Shard(0)`` of the (V, H) table) by :class:`VocabParallelEmbedding`:
  each rank looks up only its vocab range and the output is all-reduced (replicated); its weight grad
  is the local (V/N, H) shard. (DTensor's ``RowwiseParallel`` on an Embedding was found to leave a
  ``Replicate`` dense (V, H) weight grad on every rank here; at 152K x 8192 that is 5 GB fp32 per rank.)
- ``lm_head``: vocab-parallel (``Shard(0)``); the loss reads its local rows chunk by chunk;
- norms: replicated.

Sequence parallelism (``sequence_parallel=True``, torch's DTensor styles only): the decoder input is
cut into ``Shard(1)`` (sequence) shards by ``PrepareModuleInput`` on ``language_model`` (a local slice,
no communication); norms and the residual stream stay ``Shard(1)`` (``SequenceParallel``); the
attention and MLP inputs are all-gathered to the full sequence (``PrepareModuleInput`` ->
``Replicate``), and ``o_proj``/``down_proj`` reduce-scatter back to ``Shard(1)``. The rotary tables
(from the full (3, B, S) M-RoPE position ids) and the attention mask are built for the full sequence
by transformers' own forward (the DTensor input has the global shape), and attention sees the full
sequence after the all-gather. Per rank, everything saved outside attention/MLP (norm inputs, the
residual stream, the layer inputs kept by activation checkpointing) is 1/N of the sequence.
The sequence is right-padded to a multiple of N first (:func:`pad_to_multiple`: pad id, attention
mask 0, label ``IGNORE_INDEX``), so padding never reaches the loss.

The loss is ``module.loss_fn(hidden, lm_head, labels)``; :func:`apply_tp` swaps it for
:func:`vocab_parallel_loss_sum` (the chunked CE of ``dhp.ops.cross_entropy`` over the TP group): per
rank at most one chunk of fp32 logits ``(chunk, V/N)`` exists, never the full sequence's. The input
gradient of the vocab-sharded ``lm_head`` is a partial sum per rank and is always reduced over the TP
group (all-reduce without SP, reduce-scatter with SP), so the gradient to ``inputs_embeds`` and the
image embeddings is complete and identical on every TP rank.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Mapping
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from dhp.errors import PlanError
from dhp.ops.cross_entropy import IGNORE_INDEX, shifted_ce_sum
from dhp.parallel.lora import lora_tp_plan
from dhp.parallel.plan_match import match_plan, matching  # noqa: F401  (match_plan re-exported)
from dhp.parallel.ulysses import module_plan


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


def decoder_tp_plan(*, model: str, lm_head: str, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The usual decoder TP plan, FQN glob -> DTensor style (globs match one FQN atom per ``*``), for a
    transformers decoder at FQN ``model`` (``embed_tokens``, ``layers.*.{input_layernorm, self_attn.{q,k,v,o}_proj,
    post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``norm``) and its output projection ``lm_head``.
    A family calls it with its FQN prefixes in its ``parallel_plan``.

    ``sequence_parallel``: Megatron-style SP inside the TP group (see the module docstring); every
    style is torch's own, the only collectives are the ones DTensor issues for the layout changes.
    """
    layer = f"{model}.layers.*"
    if not sequence_parallel:
        return {
            f"{model}.embed_tokens": VocabParallelEmbedding(),
            f"{layer}.self_attn.q_proj": ColwiseParallel(),
            f"{layer}.self_attn.k_proj": ColwiseParallel(),
            f"{layer}.self_attn.v_proj": ColwiseParallel(),
            f"{layer}.self_attn.o_proj": RowwiseParallel(),
            f"{layer}.mlp.gate_proj": ColwiseParallel(),
            f"{layer}.mlp.up_proj": ColwiseParallel(),
            f"{layer}.mlp.down_proj": RowwiseParallel(),
            lm_head: ColwiseParallel(output_layouts=Shard(-1), use_local_output=True),
        }
    seq, full = Shard(1), Replicate()
    return {
        f"{model}.embed_tokens": VocabParallelEmbedding(),
        # the merged (text + image) embeddings enter replicated and are cut into sequence shards
        model: PrepareModuleInput(
            input_kwarg_layouts={"inputs_embeds": full},
            desired_input_kwarg_layouts={"inputs_embeds": seq},
            use_local_output=False,
        ),
        f"{layer}.input_layernorm": SequenceParallel(),
        f"{layer}.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq},
            desired_input_kwarg_layouts={"hidden_states": full},
            use_local_output=True,
        ),
        f"{layer}.self_attn.q_proj": ColwiseParallel(),
        f"{layer}.self_attn.k_proj": ColwiseParallel(),
        f"{layer}.self_attn.v_proj": ColwiseParallel(),
        f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
        f"{layer}.post_attention_layernorm": SequenceParallel(),
        f"{layer}.mlp": PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(full,), use_local_output=True
        ),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
        f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
        f"{model}.norm": SequenceParallel(),
        lm_head: ColwiseParallel(output_layouts=Shard(-1), use_local_output=True),
    }


def padded_length(seq_len: int, tp: int) -> int:
    """``seq_len`` rounded up to a multiple of ``tp`` (the sequence length every SP rank shards)."""
    return -(-seq_len // tp) * tp


def sequence_shard_bounds(seq_len: int, *, tp: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)`` token positions of TP rank ``rank``'s sequence shard of a ``seq_len`` sequence
    (after padding to a multiple of ``tp``; ``Shard(1)`` cuts equal contiguous pieces)."""
    step = padded_length(seq_len, tp) // tp
    return rank * step, (rank + 1) * step


def sequence_shard_rows(
    input_ids: torch.Tensor, image_token_id: int | tuple[int, ...], *, tp: int, rank: int
) -> torch.Tensor:
    """Bool mask over the micro-batch's image-embedding rows (row-major image-token order, as
    ``masked_scatter`` consumes them): True where the token lies in TP rank ``rank``'s sequence shard.
    Under SP a rank needs only these rows of the hand-off; the others are cut away before layer 0."""
    lo, hi = sequence_shard_bounds(input_ids.shape[1], tp=tp, rank=rank)
    is_img = torch.isin(input_ids, torch.as_tensor(image_token_id))  # image (and video) pad ids
    pos = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    return ((pos >= lo) & (pos < hi))[is_img]


#: the LLM forward's per-token (B, S) inputs and their padding values (``attention_mask`` 0 masks the
#: padding out of attention; ``labels`` ``IGNORE_INDEX`` masks it out of the loss)
_PAD_FIELDS = {"attention_mask": 0, "labels": IGNORE_INDEX, "mm_token_type_ids": 0}


def pad_to_multiple(kwargs: dict, *, multiple: int, pad_id: int) -> dict:
    """Right-pad the (B, S) token inputs of an LLM forward's kwargs to a multiple of ``multiple``."""
    seq = kwargs["input_ids"].shape[1]
    extra = padded_length(seq, multiple) - seq
    if extra == 0:
        return kwargs
    out = dict(kwargs)
    out["input_ids"] = F.pad(kwargs["input_ids"], (0, extra), value=pad_id)
    for name, value in _PAD_FIELDS.items():
        if kwargs.get(name) is not None:  # forward kwargs, not config: optional fields may be absent
            out[name] = F.pad(kwargs[name], (0, extra), value=value)
    return out


def check_divides(sizes: Mapping[str, int], *, degree: int, axis: str, module: str = "<module>") -> None:
    """Raise PlanError (before any forward) naming every size in ``sizes`` that ``degree`` does not divide."""
    bad = [f"{k}={v}" for k, v in sizes.items() if v % degree != 0]
    if bad:
        raise PlanError(
            f"modules.{module}.parallel.{axis}={degree} must divide {', '.join(bad)} (each rank holds 1/{axis} "
            f"of them). Fix: pick modules.{module}.parallel.{axis} among their common divisors, or use "
            "fsdp/dp for the rest."
        )


def local_loss_sum(
    hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, *, chunk_tokens: int, shift: bool = True
) -> torch.Tensor:
    """One process (or FSDP/DP): the chunked shifted CE SUM over the whole vocab (``dhp.ops``)."""
    return shifted_ce_sum(
        hidden, lm_head.weight, labels, bias=lm_head.bias, chunk_tokens=chunk_tokens, shift=shift
    )


def vocab_parallel_loss_sum(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    *,
    mesh: DeviceMesh,
    chunk_tokens: int = 0,
    shift: bool = True,
) -> torch.Tensor:
    """fp32 SUM of next-token CEs with ``lm_head`` sharded by vocab rows (``Shard(0)``) over ``mesh``.

    Chunked over tokens (``dhp.ops.cross_entropy``): per rank at most one chunk's fp32 logits
    ``(chunk, V/N)`` (and its gradient) exist; the loss is the full sum on every TP rank.
    ``hidden`` plain (replicated over TP): the input gradient is all-reduced over the TP group inside
    the op. ``hidden`` a ``Shard(1)`` DTensor (sequence parallel): it is all-gathered over the
    sequence here and its gradient leaves as a partial sum that DTensor reduce-scatters back into
    sequence shards; only the local shard is kept for backward (the gather and the chunked forward
    are recomputed there), so the loss holds 1/N of the sequence's hidden states per rank.
    """
    weight = lm_head.weight.to_local()
    bias = lm_head.bias.to_local() if lm_head.bias is not None else None
    kw = dict(
        bias=bias,
        chunk_tokens=chunk_tokens,
        group=mesh.get_group(),
        vocab_start=mesh.get_local_rank() * weight.shape[0],
        shift=shift,
    )
    if isinstance(hidden, DTensor):

        def gathered_loss(shard: DTensor) -> torch.Tensor:
            full = shard.redistribute(shard.device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            return shifted_ce_sum(full, weight, labels, reduce_input_grad=False, **kw)

        # keep only this rank's sequence shard for backward (not the all-gathered sequence): backward
        # all-gathers again and recomputes the chunked forward (+1 logits matmul per chunk on top of
        # backward's 3: ~ +25% of the loss FLOPs)
        return checkpoint(gathered_loss, hidden, use_reentrant=False)
    return shifted_ce_sum(hidden, weight, labels, reduce_input_grad=True, **kw)


def apply_tp(
    module: nn.Module,
    mesh: DeviceMesh,
    spec: Mapping[str, ParallelStyle] | None = None,
    *,
    sequence_parallel: bool = False,
    loss_chunk_tokens: int = 0,
    module_name: str = "<module>",
) -> nn.Module:
    """Shard ``module`` in place over the 1-D TP ``mesh`` by its family's plan (``module.parallel_plan``).

    Checks ``plan.tp_divides`` first (PlanError), distributes the weights the plan's FQN globs match
    (``spec`` overrides ``plan.tp(sequence_parallel)``) as DTensors (each rank keeps 1/N of them), sets
    the head count of ``plan.tp_heads`` attention modules to H/N, re-shares ``plan.tied`` parameters
    (e.g. ``lm_head.weight`` and ``embed_tokens.weight``, both ``Shard(0)`` of one table), and for a
    module with a loss (``plan.loss``) swaps ``loss_fn`` for the chunked vocab-parallel loss
    (``loss_chunk_tokens`` per chunk, 0 = ``dhp.ops.DEFAULT_LOSS_CHUNK_TOKENS``).
    ``sequence_parallel``: plus a forward pre-hook that right-pads the token inputs to a multiple of N
    (``plan.pad_token_id``, attention mask 0, labels ignored).
    """

    plan = module_plan(module)
    tp = mesh.size()
    if plan.tp is None:
        raise PlanError(f"module {module_name!r} has no tensor-parallel plan. Fix: use sp or fsdp/dp for it.")
    check_divides(plan.tp_divides, degree=tp, axis="tp", module=module_name)
    if tp == 1 and not plan.loss:
        return module
    tied = {
        fqn: src for fqn, src in plan.tied.items() if module.get_parameter(fqn) is module.get_parameter(src)
    }
    styles = lora_tp_plan(module, dict(spec) if spec is not None else dict(plan.tp(sequence_parallel)))
    with warnings.catch_warnings():  # LoRA: A/B follow the base layer
        if all(matching(module, [glob]) for glob in styles):
            # every glob names some module: a hybrid decoder's globs that name only some layers (e.g.
            # self_attn.* vs linear_attn) are expected to miss the others, without a warning per layer
            warnings.filterwarnings("ignore", message=r"Parallelize plan key .* could not be resolved")
        parallelize_module(module, mesh, styles)
    for fqn, src in tied.items():  # both sides sharded alike: share the one DTensor parameter again
        owner, _, attr = fqn.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, attr, module.get_parameter(src))
    for _, attn in matching(module, plan.tp_heads):
        attn.num_heads = attn.num_heads // tp
    if plan.loss:
        module.loss_fn = partial(vocab_parallel_loss_sum, mesh=mesh, chunk_tokens=loss_chunk_tokens)
    if sequence_parallel:
        pad_id = plan.pad_token_id
        module.register_forward_pre_hook(
            lambda _m, args, kwargs: (args, pad_to_multiple(kwargs, multiple=tp, pad_id=pad_id)),
            with_kwargs=True,
        )
    return module
