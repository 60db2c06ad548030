"""Per-rank memory estimate of one module: model states and activations, in bytes.

Model states (ZeRO paper accounting, bytes per parameter):

    policy             params  grads  optimizer (AdamW)
    bf16_master_fp32     2       2     12  (fp32 master 4 + exp_avg 4 + exp_avg_sq 4)
    bf16                 2       2      4  (bf16 exp_avg + exp_avg_sq)
    fp32                 4       4      8

Sharding of model states on one rank, with P the module's parameters (``params.py``):

    P_rank = (P_tp_sharded / tp + P_replicated) / fsdp      TP splits projections and vocab;
                                                            FSDP (ZeRO-3) splits everything.
    params    = P_rank * B_param  (+ FSDP: 2 unsharded layers in flight for all-gather/prefetch)
    grads     = P_rank * B_grad                              (0 when the module is frozen)
    optimizer = P_rank * B_opt / (dp * sp)  if zero == 1     ZeRO-1 shards the optimizer over the
              = P_rank * B_opt              otherwise        ranks that hold identical parameters
                                                            (data and sequence parallel replicas).
    SP and DP never shard parameters; SP shards activations.

Activations (bytes of the compute dtype ``a``: 2 for bf16 policies, 4 for fp32), per token and
per layer for a pre-norm transformer with SwiGLU MLP, h hidden, m MLP, kv the K/V width:

    per_layer = 4h + (4h + 3kv)/tp + 4m/tp
      4h:   inputs and outputs of the two RMSNorms (kept for their backward), not TP-sharded
      (4h + 3kv)/tp: q, k, v and the rotary q, k that attention keeps, its output, and the
            contiguous copy of it that feeds o_proj; sdpa/flash keep only O(S) softmax statistics
      4m/tp: gate, up, act(gate), act(gate)*up (the input of down_proj)
    Calibrated against the tensors autograd actually saves in transformers' Qwen2.5-VL on CPU
    (tests/unit/plan/test_activation_calibration.py: within 10% for the LLM and the encoder).
    eager attention adds 2 * heads/(tp*sp) * S_attn^2 per sequence (scores and probabilities)

    no activation checkpointing: tokens * L * per_layer * a
    activation checkpointing (full, per layer): tokens * (L * h + per_layer) * a
        (each layer's input is kept; one layer is recomputed at a time in backward)
    no backward (a frozen vision encoder: nothing upstream of it trains): tokens * per_layer * a
        (forward without autograd keeps one layer's working set at a time). A frozen LLM still
        runs backward, to give the encoder the gradient of its outputs.

Tokens per rank: vision ``seq_len / sp`` (patches of one micro-batch, cut by Ulysses SP); LLM
``micro_batch * seq_len`` (TP, FSDP and DP do not cut the sequence). Module extras:

    vision: pixel rows (fp32, C*T*P*P each) + merger (RMSNorm in/out 2h, MLP in/GELU in/out 3h per
            patch, output out_hidden per merged token)
    llm:    logits of the lm_head (a) + their fp32 log-softmax kept by the loss (4) + its gradient
            (4), vocab-parallel under TP: tokens * V/tp * (a + 8); plus the final norm (2h)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig

from dhp.config.ac import parse_ac_mode
from dhp.plan.params import LayerShape, ParamCount, llm_layer, module_params, vision_layer
from dhp.plan.types import MemoryEstimate

# bytes per parameter: (params, grads, optimizer states)
STATE_BYTES: dict[str, tuple[int, int, int]] = {
    "bf16_master_fp32": (2, 2, 12),
    "bf16": (2, 2, 4),
    "fp32": (4, 4, 8),
}
ACT_BYTES: dict[str, int] = {"bf16_master_fp32": 2, "bf16": 2, "fp32": 4}
# ZeRO-1 shards the optimizer over the ranks holding identical parameters (docs/INTERFACES.md).
ZERO1_AXES = ("dp", "sp")
FSDP_LAYERS_IN_FLIGHT = 2  # the layer being computed and the prefetched next one
# Held back from device memory: CUDA context + NCCL/gloo buffers (1 GiB) and allocator
# fragmentation (5% of the device).
RESERVE_FIXED_BYTES = 1 << 30
RESERVE_FRACTION = 0.05


def reserve_bytes(device_memory_bytes: int) -> int:
    """Bytes of a device that the plan never counts as usable (see RESERVE_* above)."""
    return RESERVE_FIXED_BYTES + int(RESERVE_FRACTION * device_memory_bytes)


@dataclass(frozen=True)
class ModuleShape:
    """What the estimate needs about one module, independent of the rank."""

    name: str
    params: ParamCount
    layer: LayerShape
    parallel: DictConfig
    seq_len: int
    micro_batch: int
    activation_checkpointing: bool
    freeze: bool
    backward: bool  # False only for a frozen module that feeds nothing trainable upstream
    mixed_precision: str
    attn_implementation: str


def model_states(shape: ModuleShape) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes on one rank; formulas in the module docstring."""
    par = shape.parallel
    b_param, b_grad, b_opt = STATE_BYTES[shape.mixed_precision]
    p_rank = shape.params.per_tp_rank(par.tp) / par.fsdp
    params = p_rank * b_param
    if par.fsdp > 1:
        layer_full = shape.params.per_tp_rank(par.tp) / max(shape.layer.layers, 1)
        params += FSDP_LAYERS_IN_FLIGHT * layer_full * b_param
    if shape.freeze:
        return int(params), 0, 0
    opt_shards = math.prod(par[a] for a in ZERO1_AXES) if par.zero == 1 else 1
    return int(params), int(p_rank * b_grad), int(p_rank * b_opt / opt_shards)


def _per_layer_elems(layer: LayerShape, tp: int) -> float:
    h, m, kv = layer.hidden, layer.mlp, layer.kv_dim
    return 4 * h + (4 * h + 3 * kv) / tp + 4 * m / tp


def _layers_bytes(shape: ModuleShape, tokens: float, a: int) -> int:
    layer, tp = shape.layer, shape.parallel.tp
    per_layer = _per_layer_elems(layer, tp)
    if not shape.backward:
        return int(tokens * per_layer * a)
    if shape.activation_checkpointing:
        return int(tokens * (layer.layers * layer.hidden + per_layer) * a)
    return int(tokens * layer.layers * per_layer * a)


def _eager_bytes(shape: ModuleShape, *, seqs: int, seq: float, layers: int, a: int) -> int:
    """Scores + probabilities of eager attention: 2 * heads/(tp*sp) * S^2 per sequence and layer."""
    if shape.attn_implementation != "eager":
        return 0
    heads = shape.layer.heads / (shape.parallel.tp * shape.parallel.sp)
    kept_layers = 1 if shape.activation_checkpointing else layers
    return int(2 * heads * seq * seq * seqs * kept_layers * a)


def vision_activations(shape: ModuleShape, vision: DictConfig, *, out_hidden: int) -> dict[str, int]:
    """Activation bytes of one vision rank, by component (formulas in the module docstring)."""
    a = ACT_BYTES[shape.mixed_precision]
    tokens = shape.seq_len / shape.parallel.sp
    h, merge = vision.hidden_size, vision.spatial_merge_size**2
    row = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    window = (vision.window_size // vision.patch_size) ** 2  # patches per attention window
    n_full = len(vision.fullatt_block_indexes)
    eager = _eager_bytes(shape, seqs=1, seq=shape.seq_len, layers=n_full, a=a)
    eager += _eager_bytes(
        shape, seqs=max(int(shape.seq_len // window), 1), seq=window, layers=vision.depth - n_full, a=a
    )
    return {
        "layers": _layers_bytes(shape, tokens, a),
        "attention_scores": eager,
        "inputs": int(tokens * row * 4),
        "merger": int(tokens * (2 * h + 3 * h) * a + tokens / merge * out_hidden * a),
    }


def llm_activations(shape: ModuleShape, llm: DictConfig) -> dict[str, int]:
    """Activation bytes of one LLM rank, by component (formulas in the module docstring)."""
    a = ACT_BYTES[shape.mixed_precision]
    tokens = shape.micro_batch * shape.seq_len
    vocab_shard = llm.vocab_size / shape.parallel.tp
    return {
        "layers": _layers_bytes(shape, tokens, a),
        "attention_scores": _eager_bytes(
            shape, seqs=shape.micro_batch, seq=shape.seq_len, layers=llm.num_layers, a=a
        ),
        "logits_loss": int(tokens * vocab_shard * (a + 8)),
        "final_norm": int(tokens * 2 * llm.hidden_size * a),
    }


def module_shape(name: str, *, model: DictConfig, module: DictConfig, micro_batch: int) -> ModuleShape:
    """Collect the sizes of module ``name`` that the estimate reads."""
    layer = vision_layer(model.vision) if name == "vision" else llm_layer(model.llm)
    return ModuleShape(
        name=name,
        params=module_params(name, model),
        layer=layer,
        parallel=module.parallel,
        seq_len=module.seq_len,
        micro_batch=micro_batch,
        activation_checkpointing=parse_ac_mode(module.activation_checkpointing).enabled,
        freeze=module.freeze,
        backward=not (module.freeze and name == "vision"),
        mixed_precision=module.mixed_precision,
        attn_implementation=model.attn_implementation,
    )


def estimate_module(shape: ModuleShape, *, model: DictConfig) -> MemoryEstimate:
    """Peak bytes of one rank of the module (every rank of a group is symmetric)."""
    params, grads, optimizer = model_states(shape)
    if shape.name == "vision":
        detail = vision_activations(shape, model.vision, out_hidden=model.llm.hidden_size)
    else:
        detail = llm_activations(shape, model.llm)
    return MemoryEstimate(
        params=params, grads=grads, optimizer=optimizer, activations=sum(detail.values()), detail=detail
    )
