"""Qwen3.5's architecture, dense and MoE flavours, without torch (``ARCH``): its numbers and checks,
its typed hybrid decoder and the LLM's parallel axes.

Qwen3.5 is the Qwen3 vision encoder without DeepStack (``dhp/models/qwen3_vision/arch.py``, K = 0)
feeding a hybrid Qwen3 decoder (``dhp/models/qwen3_base``): ``layer_types`` repeats
``full_attention_interval - 1`` Gated DeltaNet layers (linear attention: a recurrent state of
``key_head_dim x value_head_dim`` per value head, a short causal conv1d over q/k/v) and one gated
full-attention layer (GQA with a sigmoid output gate from a second half of q_proj, per-head q/k
RMSNorms, partial interleaved M-RoPE). Every layer has a SwiGLU MLP (dense flavour, ``qwen3_5``) or,
in the MoE flavour (``qwen3_5_moe``, Qwen3.5-35B-A3B and larger), a sparse MoE block: a top-k router
[E, H], E routed SwiGLU experts of ``moe_intermediate_size`` (3-D ``experts.gate_up_proj`` [E, 2I, H]
and ``experts.down_proj`` [E, H, I]) and one always-on shared SwiGLU expert of
``model.llm.intermediate_size`` scaled by a sigmoid gate (a Linear H -> 1).

``model.llm.extra``: ``head_dim``, ``hidden_act``, ``mrope_section``, ``mrope_interleaved``,
``partial_rotary_factor`` (rotary on that fraction of head_dim), ``full_attention_interval``,
``linear_num_key_heads``, ``linear_num_value_heads``, ``linear_key_head_dim``,
``linear_value_head_dim``, ``linear_conv_kernel_dim``; the MoE flavour adds ``num_experts``,
``num_experts_per_tok``, ``moe_intermediate_size`` and ``router_aux_loss_coef`` (all four, or none).

Counts (``qwen3_base``'s helpers plus the DeltaNet layer's): full-attention layer: q h->2*heads*head_dim
(query + output gate), k/v, o (sharded), q_norm/k_norm (replicated); Gated DeltaNet layer:
in_proj_qkv h->2*Kd+Vd, in_proj_z h->Vd, in_proj_b/in_proj_a h->Hv, depthwise conv1d over the 2*Kd+Vd
channels (kernel k, no bias), dt_bias and A_log (Hv each), out_proj Vd->h (Kd = Hk*dk, Vd = Hv*dv): all
split by head group under TP; the gated RMSNorm's weight (dv, shared by every head) is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dhp.config.issues import Issues
from dhp.errors import CheckpointError
from dhp.models.arch import Attention, Block, Capabilities, ModuleArch, ModuleAxes, ParamCount
from dhp.models.qwen3_base import arch as base
from dhp.models.qwen3_base.config import text_numbers_from_hf
from dhp.models.qwen3_vision.arch import vision_tp_sharded

LINEAR, FULL = "linear_attention", "full_attention"

#: What this family's runtime does exactly. Packing, in both flavours (per-sample positions, full
#: attention kept inside each sample, every Gated DeltaNet layer run once per sample:
#: dhp.parallel.linear_attn_packed; tests/parity/test_packing.py). Video is not declared (no video
#: parity test), so validation refuses video data for this family.
CAPABILITIES = Capabilities(
    packing=True,
    video=False,
    tp_sharded={
        "vision": vision_tp_sharded(deepstack=False),
        "llm": (
            "*.embed_tokens",
            "*.layers.*.self_attn.*_proj",
            "*.layers.*.linear_attn.in_proj_*",
            "*.layers.*.linear_attn.conv1d",
            "*.layers.*.linear_attn.dt_bias",
            "*.layers.*.linear_attn.A_log",
            "*.layers.*.linear_attn.out_proj",
            "*.layers.*.mlp.gate_proj",
            "*.layers.*.mlp.up_proj",
            "*.layers.*.mlp.down_proj",
            "*.layers.*.mlp.shared_expert.*",  # MoE flavour; its gate, router and experts are not TP-sharded
            "lm_head",
        ),
    },
)
#: the Gated DeltaNet layers' sizes in ``model.llm.extra`` (positive integers, as ``head_dim``)
_LINEAR_SIZES = (
    "full_attention_interval",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def layer_types_of(layers: int, interval: int) -> tuple[str, ...]:
    """transformers' pattern: layer i is full attention when ``(i + 1) % interval == 0``, else linear."""
    return tuple(LINEAR if (i + 1) % interval else FULL for i in range(layers))


@dataclass(frozen=True, kw_only=True)
class Numbers(base.TextNumbers):
    """Every architecture number of a Qwen3.5 model, from the schema or a transformers config."""

    layer_types: tuple[str, ...]
    partial_rotary_factor: float
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    conv_kernel: int

    @property
    def layers(self) -> int:
        return len(self.layer_types)

    @property
    def key_dim(self) -> int:
        """DeltaNet q/k width: ``linear_num_key_heads * linear_key_head_dim``."""
        return self.linear_k_heads * self.linear_k_dim

    @property
    def value_dim(self) -> int:
        """DeltaNet v / output width: ``linear_num_value_heads * linear_value_head_dim``."""
        return self.linear_v_heads * self.linear_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv1d (q, k, v together)."""
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        """Rotary channels per head: ``head_dim * partial_rotary_factor``."""
        return int(self.head_dim * self.partial_rotary_factor)


def layer_params(n: Numbers, kind: str) -> ParamCount:
    """One decoder layer of ``kind``: its token mixer, the two norms and its MLP (the dense SwiGLU, or
    the MoE block with the shared expert)."""
    mlp = base.mlp_params(n, sparse=n.moe, shared=True)
    if kind == FULL:
        return base.attention_params(n, gated=True) + mlp
    h, hv = n.hidden, n.linear_v_heads
    projections = h * n.conv_dim + h * n.value_dim + 2 * h * hv + n.value_dim * h
    return mlp + ParamCount(
        tp_sharded=projections + n.conv_dim * n.conv_kernel + 2 * hv, replicated=n.linear_v_dim
    )


class Qwen3_5Arch(base.Qwen3Arch):
    """:class:`dhp.models.arch.FamilyArch` of Qwen3.5 (reads ``model.vision.extra`` / ``model.llm.extra``)."""

    dense = base.Flavour("qwen3_5", example="qwen3_5_27b")
    moe = base.Flavour("qwen3_5_moe", example="qwen3_5_35b_a3b")
    display = "Qwen3.5"
    capabilities = CAPABILITIES
    deepstack = False
    llm_extra = (
        "head_dim",
        "hidden_act",
        "mrope_section",
        "mrope_interleaved",
        "partial_rotary_factor",
        *_LINEAR_SIZES,
    )
    mrope_rule = (
        "head_dim * partial_rotary_factor",
        "use the published [11, 11, 10] for head_dim 256 and factor 0.25",
    )

    def numbers(self, model: Any) -> Numbers:
        t, te = model.llm, model.llm.extra
        return Numbers(
            **base.text_numbers(model, deepstack=False),
            layer_types=layer_types_of(t.num_layers, int(te["full_attention_interval"])),
            partial_rotary_factor=float(te["partial_rotary_factor"]),
            linear_k_heads=te["linear_num_key_heads"],
            linear_v_heads=te["linear_num_value_heads"],
            linear_k_dim=te["linear_key_head_dim"],
            linear_v_dim=te["linear_value_head_dim"],
            conv_kernel=te["linear_conv_kernel_dim"],
        )

    def numbers_from_hf(self, cfg: Any) -> Numbers:
        t, moe = cfg.text_config, cfg.model_type == self.moe.name
        rope = t.rope_parameters
        if "partial_rotary_factor" not in rope:
            raise CheckpointError(
                f"text_config.rope_parameters {rope} has no partial_rotary_factor. Fix: load the config "
                f"through transformers' Qwen3_5Config, which sets it."
            )
        return Numbers(
            **text_numbers_from_hf(cfg, deepstack=False, moe=moe),
            mlp=t.shared_expert_intermediate_size if moe else t.intermediate_size,
            layer_types=tuple(t.layer_types),
            partial_rotary_factor=float(rope["partial_rotary_factor"]),
            linear_k_heads=t.linear_num_key_heads,
            linear_v_heads=t.linear_num_value_heads,
            linear_k_dim=t.linear_key_head_dim,
            linear_v_dim=t.linear_value_head_dim,
            conv_kernel=t.linear_conv_kernel_dim,
        )

    def check_raw(self, model: Any, issues: Issues) -> None:
        te = model.llm.extra
        base.check_positive_ints(te, ("head_dim", *_LINEAR_SIZES), issues, example=self.dense.example)
        interval = te["full_attention_interval"]
        issues.check(
            not base.positive_int(interval) or interval <= model.llm.num_layers,
            "model.llm.extra.full_attention_interval",
            interval,
            f"must be <= model.llm.num_layers={model.llm.num_layers} (layer interval-1 is the first "
            "full-attention layer)",
            "use the published 4",
        )

    def check_numbers(self, n: Numbers, issues: Issues) -> None:
        issues.check(
            n.linear_v_heads % n.linear_k_heads == 0,
            "model.llm.extra.linear_num_key_heads",
            n.linear_k_heads,
            f"must divide linear_num_value_heads={n.linear_v_heads} (each key head serves a group of value heads)",
            "use the published 16 key heads for 48 value heads",
        )
        issues.check(
            0.0 < n.partial_rotary_factor <= 1.0 and n.rotary_dim % 2 == 0,
            "model.llm.extra.partial_rotary_factor",
            n.partial_rotary_factor,
            f"must be in (0, 1] and give an even rotary width (head_dim={n.head_dim})",
            "use the published 0.25",
        )

    def llm_arch(self, n: Numbers) -> ModuleArch:
        """Each decoder layer's token mixer by ``layer_types``: Gated DeltaNet (``linear``: value heads,
        key heads, value head width, state dk x dv per head) or causal gated GQA (``full``); the MLP is
        the dense SwiGLU, or in the MoE flavour ``Mlp(kind="moe")``: E experts of I, top-k active, plus
        the shared expert's width."""
        mlp = base.moe_mlp(n, shared=n.mlp) if n.moe else base.dense_mlp(n)
        full = base.full_attention(n)
        linear = Attention(
            kind="linear",
            heads=n.linear_v_heads,
            kv_heads=n.linear_k_heads,
            head_dim=n.linear_v_dim,
            state=n.linear_k_dim * n.linear_v_dim,
            causal=True,
        )
        largest = [n.hidden * n.mlp]
        if n.moe:
            largest.append(n.experts * 2 * n.moe_mlp * n.hidden)  # experts.gate_up_proj [E, 2I, H]
        if FULL in n.layer_types:
            largest.append(n.hidden * 2 * n.q_dim)
        if LINEAR in n.layer_types:
            largest += [n.hidden * n.conv_dim, n.hidden * n.value_dim]
        return base.decoder_arch(
            n,
            blocks=tuple(Block(linear if kind == LINEAR else full, mlp) for kind in n.layer_types),
            layer_params=[layer_params(n, kind) for kind in n.layer_types],
            largest=largest,
            tp_input_grads=5,  # full: q, k, v, gate, up; DeltaNet: qkv, z, b, a (+ gate, up) counted alike
            # full: 2 norms, q/k/v/o, q_norm, k_norm, gate/up/down (DeltaNet: 12; MoE: + router, shared
            # expert gate, gate_up, down)
            tensors_per_block=15 if n.moe else 11,
        )

    def llm_axes(self, n: Numbers) -> ModuleAxes:
        """TP over the gated-attention heads, the Gated DeltaNet key/value head groups, the vocabulary
        and the MLP (or shared expert) width, with Megatron sequence parallelism inside TP in the dense
        flavour only (an MoE block adds the routed experts' whole-sequence output to the shared
        expert's); no Ulysses SP (the DeltaNet recurrence runs along the whole sequence)."""
        heads = {
            "model.llm.extra.linear_num_key_heads": n.linear_k_heads,
            "model.llm.extra.linear_num_value_heads": n.linear_v_heads,
        }
        return base.decoder_axes(
            n, sequence_parallel=not n.moe, heads=heads, context_parallel=True, cp_divides=heads
        )


ARCH = Qwen3_5Arch()
