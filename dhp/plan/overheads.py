"""Per-call overheads of a step: how many host-side calls each phase makes (counts, no seconds).

A step is not only FLOPs and bytes. Every call costs fixed host time before any work: Python and
torch's op dispatch per operator (several times more through a DTensor), gloo's or NCCL's setup per
collective, an attention kernel launch per sequence the encoder's window loop visits, and AdamW,
the grad norm and the clip walking the parameter list one tensor at a time. On a GPU the host runs
ahead of the device and these hide behind the kernels (their profile coefficients default to 0); on a
CPU, or with tiny shapes, they ARE the step. The step-time model multiplies each count by a profile
coefficient in seconds per call (``dhp/plan/estimate.py``), which ``dhp calibrate`` fits:

    count (per rank)    forward                          backward                  coefficient
    blocks              L + 1 (blocks + the head)        2 (L + 1) + ck            block_overhead_s
    dtensor_blocks      blocks, when the module's        same                      dtensor_block_overhead_s
                        weights are TP DTensors
    fsdp_blocks         L + 1 when the module is         L + 1 + ck                fsdp_block_overhead_s
                        FSDP-sharded (each block's
                        unshard/reshard hooks)
    attention_calls     encoder: per window block the    same (+ ck/L of it)       attention_call_overhead_s
                        windows on the rank, per full
                        block the images it attends;
                        LLM: L
    collectives         Ulysses 2 per full block (qkv,   Ulysses the same; TP 1    collective_overhead_s
                        out) + 1 rotary gather; TP 2     all-reduce per column-
                        per block (x2 under SP: RS+AG),  parallel input's grad
                        LLM +1 embedding all-reduce;     (``tp_input_grads``, +2
                        FSDP 1 all-gather per block;     AG under SP); FSDP all-
                        loss 2 all-reduces per chunk     gather + reduce-scatter
                        (vocab TP); EP 3 per MoE block   per block; loss 1 (+1 AG
                                                         under SP); + the
                                                         recomputed forward's; EP
                                                         2 per MoE block; + the
                                                         forward's all-to-alls of
                                                         every block under
                                                         selective AC
                        expert TP 1 output all-gather    expert TP 1 reduce-scatter
                        per MoE block; expert FSDP 1     per MoE block (+ the
                        experts' all-gather per MoE      recomputed); expert FSDP
                        block                            all-gather + reduce-scatter
                                                         per MoE block
    step (once)         tensors = the rank's parameter tensors (norm, clip, AdamW, zero_grad: a loop
                        over them; x2 for DTensor parameters; ZeRO-1: AdamW's share on the owned ones
                        only), and collectives: 1 grad-norm all-reduce,
                        1 SP and 1 DP gradient all-reduce, dp*sp ZeRO-1 owner broadcasts

``L`` blocks, ``ck`` the blocks recomputed under activation checkpointing (``backward`` runs about
twice the forward's operators). The parameter-tensor count is the only architecture knowledge here
(:func:`param_tensors`).
"""

from __future__ import annotations

import math

from dhp.plan.memory import ModuleShape, checkpointed_blocks, recomputed_exchanges
from dhp.plan.tp_blocks import tp_block

#: AdamW's share of the per-tensor ops of a step (about 10 of the 14: the rest are the grad norm,
#: the clip and zero_grad, which every rank runs on every tensor)
ADAMW_SHARE = 0.7
#: A DTensor parameter costs about twice a plain one in the per-tensor loops (dispatch through
#: DTensor's sharding propagation before the local kernel).
DTENSOR_TENSOR_FACTOR = 2.0


def param_tensors(shape: ModuleShape) -> float:
    """Parameter tensors one rank steps over (the per-tensor loops of norm, clip and AdamW), in
    whole-loop units: under ZeRO-1 AdamW's share of a tensor's ops runs on its owner only."""
    n = shape.layer.layers * shape.arch.tensors_per_block + shape.arch.root_tensors
    par = shape.layout
    dtensor = par.tp > 1 or par.fsdp > 1
    owners = par.optimizer_shards
    share = (1.0 - ADAMW_SHARE) + ADAMW_SHARE / owners
    return n * share * (DTENSOR_TENSOR_FACTOR if dtensor else 1.0)


def attention_calls(shape: ModuleShape, tokens: float) -> float:
    """Attention calls of one forward on a rank seeing ``tokens`` tokens (see the module docstring),
    per block by its declared attention: a causal block is one call; a non-causal full block one per
    image (all images under Ulysses: it sees every token); a window block one per window."""
    image = shape.image_patches or shape.seq_len
    all_tokens = tokens * shape.layout.sp  # Ulysses: full blocks see every token, heads/sp
    images = max(all_tokens / image, 1.0) if shape.layout.sp > 1 else max(tokens / image, 1.0)
    calls = 0.0
    for block in shape.arch.blocks:
        att = block.attention
        if att.causal or att.kind == "linear":
            calls += 1
        elif att.kind == "window":
            calls += math.ceil(max(tokens / min(att.window, image), 1.0))
        else:
            calls += math.ceil(images)
    return float(calls)


def collectives(shape: ModuleShape, tokens: float) -> tuple[float, float]:
    """(forward, backward) collective calls of one rank per micro-batch."""
    par, lay = shape.layout, shape.layer
    ck = checkpointed_blocks(shape.ac, lay.layers) if shape.backward else 0
    again = recomputed_exchanges(shape.ac, lay.layers)  # blocks re-issuing their all-to-alls
    fwd = bwd = 0.0
    if par.sp > 1:  # per full block: qkv (fused) and out; plus one rotary-table gather a forward
        n_full = shape.arch.sp_exchange_blocks
        fwd += 2 * n_full + 1
        bwd += 2 * n_full + (2 * n_full + 1) * again / lay.layers
    if par.tp > 1:
        sp = 2 if shape.layout.sequence_parallel else 1  # SP inside TP: a reduce-scatter + an all-gather each
        blocks = [tp_block(b, shape.arch, par.tp) for b in shape.arch.blocks]  # dhp/plan/tp_blocks.py
        moves = sum(len(c.relayout) for c in blocks)  # the linear blocks' weight all-to-alls
        fwd_blocks = sum(c.fwd_reduces for c in blocks) * sp  # the mixers' and MLPs' outputs
        # one all-reduce per column-parallel input's grad; SP all-gathers the two outputs' grads
        grads = sum(c.bwd_reduces + c.bwd_small for c in blocks) + (2 if sp == 2 else 0) * len(blocks)
        fwd += fwd_blocks + moves
        bwd += grads + moves * (1 + again / lay.layers) + fwd_blocks * ck / lay.layers
        if shape.arch.vocab:  # the vocab-parallel embedding; the loss: 2 a chunk, 1 for its grad;
            # under SP the merged embeddings' grad is all-gathered back to the full sequence
            chunks = math.ceil(tokens / max(shape.loss_chunk_tokens, 1))
            fwd += 1 + 2 * chunks
            bwd += 1 + (1 if shape.layout.sequence_parallel else 0)
    if par.fsdp > 1:
        fwd += lay.layers + 1
        bwd += 2 * (lay.layers + 1)
    if par.expert_group > 1:  # per MoE block: the per-expert counts, dispatch, combine; backward the
        moe = shape.arch.moe_blocks  # reverse two + the forward's three again where they are recomputed
        fwd += 3 * moe
        bwd += 2 * moe + 3 * moe * again / lay.layers
    if par.etp > 1:  # per MoE block: the output's all-gather over TP; backward its reduce-scatter
        moe = shape.arch.moe_blocks  # + the checkpointed blocks' gather again
        fwd += moe
        bwd += moe + moe * ck / lay.layers
    if par.expert_fsdp and par.edp > 1:  # per MoE block: the experts' all-gather each way, the
        moe = shape.arch.moe_blocks  # grads' reduce-scatter in backward
        fwd += moe
        bwd += 2 * moe
    return fwd, (bwd if shape.backward else 0.0)


def step_collectives(shape: ModuleShape) -> float:
    """Collective calls of the once-per-step finish (grad sync, grad norm, ZeRO-1 broadcasts)."""
    if shape.freeze:
        return 0.0
    par = shape.layout
    n = 1.0  # the grad-norm all-reduce
    n += 1.0 if par.sp > 1 else 0.0
    n += 1.0 if par.dp > 1 and par.fsdp == 1 else 0.0
    n += float(par.optimizer_shards) if par.optimizer_shards > 1 else 0.0
    return n


def phase_counts(shape: ModuleShape, tokens: float) -> dict[str, dict[str, float]]:
    """``{"fwd", "bwd", "step"}`` -> the call counts of that phase on one rank (per micro-batch for
    fwd/bwd, per step for step), keyed like ``dhp.plan.estimate.FEATURES``."""
    lay = shape.layer
    ck = checkpointed_blocks(shape.ac, lay.layers) if shape.backward else 0
    dt = 1.0 if shape.layout.tp > 1 else 0.0
    attn = attention_calls(shape, tokens)
    c_fwd, c_bwd = collectives(shape, tokens)
    fwd_blocks = float(lay.layers + 1)
    bwd_blocks = 2.0 * (lay.layers + 1) + ck if shape.backward else 0.0
    back = 1.0 if shape.backward else 0.0
    fs = 1.0 if shape.layout.fsdp > 1 else 0.0  # FSDP2: a pre- and post-hook per sharded block
    return {
        "fwd": {
            "blocks": fwd_blocks,
            "dtensor_blocks": dt * fwd_blocks,
            "fsdp_blocks": fs * fwd_blocks,
            "attention_calls": attn,
            "collectives": c_fwd,
        },
        "bwd": {
            "blocks": bwd_blocks,
            "dtensor_blocks": dt * bwd_blocks,
            "fsdp_blocks": fs * back * (lay.layers + 1 + ck),
            "attention_calls": back * attn * (1 + ck / lay.layers),
            "collectives": c_bwd,
        },
        "step": {
            "tensors": 0.0 if shape.freeze else param_tensors(shape),
            "collectives": step_collectives(shape),
        },
    }
