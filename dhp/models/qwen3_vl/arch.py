"""Qwen3-VL's architecture, dense and MoE flavours, without torch (``ARCH``): its numbers and checks,
its typed decoder and the LLM's parallel axes.

Qwen3-VL is the Qwen3 vision encoder with DeepStack (``dhp/models/qwen3_vision``: encoder blocks whose
merged features are added to the LLM's hidden states after layers 0, 1, ...) feeding a Qwen3 decoder
(``dhp/models/qwen3_base``). Two flavours, one code path:

- dense (``qwen3_vl``, Qwen3-VL-8B/32B): every decoder layer has a SwiGLU MLP of
  ``model.llm.intermediate_size``;
- MoE (``qwen3_vl_moe``, Qwen3-VL-30B-A3B/235B-A22B; declared by ``model.llm.extra.num_experts``, or by
  ``model.family: qwen3_vl_moe``): decoder layer ``i`` is sparse (a top-k router [E, H], E experts of
  ``moe_intermediate_size`` as 3-D ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj``
  [E, H, I]) unless ``i`` is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; the
  other layers are dense SwiGLUs.

``model.vision.extra``: ``num_position_embeddings``, ``deepstack_visual_indexes``, ``hidden_act``.
``model.llm.extra``: ``head_dim`` (not ``hidden / heads`` in the 32B), ``hidden_act``, ``mrope_section``,
``mrope_interleaved``; the MoE flavour adds ``num_experts`` (E), ``num_experts_per_tok`` (top-k),
``moe_intermediate_size`` (I), ``router_aux_loss_coef`` (weight of the load-balancing loss added to the
LM loss), ``decoder_sparse_step``, ``mlp_only_layers`` and ``norm_topk_prob`` (transformers' router
always renormalises the top-k probabilities, so only ``true`` builds the model it runs).

Counts (``qwen3_base``'s helpers): ``tp_sharded`` attention q/k/v/o, the dense layers' gate/up/down,
vocab-parallel embeddings and lm_head; ``replicated`` norms, q_norm/k_norm and each sparse layer's
router (EP replicates it, TP does not shard it); ``expert`` ``3 * E * I * H`` per sparse layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dhp.config.issues import Issues
from dhp.models.arch import Block, Capabilities, ModuleArch, ModuleAxes, ParamCount
from dhp.models.qwen3_base import arch as base
from dhp.models.qwen3_base.config import text_numbers_from_hf
from dhp.models.qwen3_vision.arch import vision_tp_sharded

#: What this family's runtime does exactly. Packing and video are not declared: the LLM's position
#: ids and DeepStack placement have no per-sample (packed) path and no video parity test, so
#: validation refuses ``data.packing`` and video data for this family.
CAPABILITIES = Capabilities(
    packing=False,
    video=False,
    tp_sharded={
        "vision": vision_tp_sharded(deepstack=True),
        # the sparse layers' router (mlp.gate) and experts (mlp.experts) are not TP-sharded
        "llm": (
            "*.embed_tokens",
            "*.layers.*.self_attn.*_proj",
            "*.layers.*.mlp.gate_proj",
            "*.layers.*.mlp.up_proj",
            "*.layers.*.mlp.down_proj",
            "lm_head",
        ),
    },
)
SPARSE_EXTRA = ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")


@dataclass(frozen=True, kw_only=True)
class Numbers(base.TextNumbers):
    """Every architecture number of a Qwen3-VL model, from the schema or from a transformers config."""

    layers: int
    sparse_step: int = 1
    mlp_only: tuple[int, ...] = ()
    norm_topk_prob: bool = True

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` holds a router + experts (transformers' rule)."""
        return layer not in self.mlp_only and self.experts > 0 and (layer + 1) % self.sparse_step == 0

    @property
    def sparse_layers(self) -> int:
        return sum(1 for i in range(self.layers) if self.is_sparse(i))


def layer_params(n: Numbers) -> list[ParamCount]:
    """Each decoder layer: attention, the two norms and its MLP (sparse block or dense SwiGLU)."""
    attention = base.attention_params(n)
    return [attention + base.mlp_params(n, sparse=n.is_sparse(i)) for i in range(n.layers)]


class Qwen3VLArch(base.Qwen3Arch):
    """:class:`dhp.models.arch.FamilyArch` of Qwen3-VL (reads ``model.vision.extra`` / ``model.llm.extra``)."""

    dense = base.Flavour("qwen3_vl", example="qwen3_vl_8b")
    moe = base.Flavour("qwen3_vl_moe", example="qwen3_vl_30b_a3b")
    display = "Qwen3-VL"
    capabilities = CAPABILITIES
    deepstack = True
    llm_extra = ("head_dim", "hidden_act", "mrope_interleaved", "mrope_section")
    moe_extra = (*base.MOE_EXTRA, *SPARSE_EXTRA)

    def numbers(self, model: Any) -> Numbers:
        te = model.llm.extra
        sparse = (
            dict(
                sparse_step=te["decoder_sparse_step"],
                mlp_only=tuple(te["mlp_only_layers"]),
                norm_topk_prob=bool(te["norm_topk_prob"]),
            )
            if base.is_moe(model)
            else {}
        )
        return Numbers(**base.text_numbers(model, deepstack=True), layers=model.llm.num_layers, **sparse)

    def numbers_from_hf(self, cfg: Any) -> Numbers:
        """``norm_topk_prob`` is true whatever the file says: it is what transformers' router computes."""
        t, moe = cfg.text_config, cfg.model_type == self.moe.name
        sparse = dict(sparse_step=t.decoder_sparse_step, mlp_only=tuple(t.mlp_only_layers)) if moe else {}
        return Numbers(
            **text_numbers_from_hf(cfg, deepstack=True, moe=moe),
            mlp=t.intermediate_size,
            layers=t.num_hidden_layers,
            **sparse,
        )

    def check_raw(self, model: Any, issues: Issues) -> None:
        """The sparse-layer pattern (MoE flavour): a positive step, decoder layer indexes, a boolean."""
        if not base.is_moe(model):
            return
        te = model.llm.extra
        base.check_positive_ints(te, ("decoder_sparse_step",), issues, example=self.moe.example)
        layers = te["mlp_only_layers"]
        issues.check(
            isinstance(layers, Sequence)
            and not isinstance(layers, str)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in layers),
            "model.llm.extra.mlp_only_layers",
            layers,
            "must be a list of decoder layer indexes",
            "use the published [] (no dense layers)",
        )

    def check_numbers(self, n: Numbers, issues: Issues) -> None:
        if not n.moe:
            return
        p = "model.llm.extra"
        bad = [i for i in n.mlp_only if not 0 <= i < n.layers]
        issues.check(
            not bad and len(set(n.mlp_only)) == len(n.mlp_only),
            f"{p}.mlp_only_layers",
            list(n.mlp_only),
            f"must be distinct decoder layer indexes in [0, num_layers={n.layers}) (out of range: {bad})",
            "use the published [] (no dense layers)",
        )
        issues.check(
            n.sparse_layers >= 1,
            f"{p}.mlp_only_layers",
            list(n.mlp_only),
            f"with these and decoder_sparse_step={n.sparse_step} no decoder layer is sparse: a dense model",
            "train it with the dense flavour (drop the MoE keys, model.family: qwen3_vl), or leave a layer sparse",
        )
        issues.check(
            n.norm_topk_prob,
            f"{p}.norm_topk_prob",
            n.norm_topk_prob,
            "transformers' Qwen3-VL-MoE router always renormalises the top-k probabilities",
            "set it to true",
        )

    def llm_arch(self, n: Numbers) -> ModuleArch:
        """Per decoder layer causal GQA attention and the sparse MLP (``Mlp(kind="moe")``: E experts of
        I, top-k active, no shared expert) or the dense SwiGLU. The router's ``E*H`` MACs per token and
        sparse layer are left out of ``block_macs`` (2 % of the experts' in the 30B-A3B)."""
        attn, moe, dense = base.full_attention(n), base.moe_mlp(n), base.dense_mlp(n)
        largest = [n.hidden * n.q_dim]
        if n.sparse_layers:
            largest.append(n.experts * 2 * n.moe_mlp * n.hidden)  # experts.gate_up_proj [E, 2I, H]
        if n.sparse_layers < n.layers:
            largest.append(n.hidden * n.mlp)
        return base.decoder_arch(
            n,
            blocks=tuple(Block(attn, moe if n.is_sparse(i) else dense) for i in range(n.layers)),
            layer_params=layer_params(n),
            largest=largest,
            # q, k, v; plus gate and up where a dense layer exists (a sparse MLP is replicated over TP,
            # so its input gradient needs no all-reduce)
            tp_input_grads=3 if n.sparse_layers == n.layers else 5,
            tensors_per_block=11,  # 2 norms, q/k/v/o, q_norm, k_norm + router, gate_up, down (or gate/up/down)
        )

    def llm_axes(self, n: Numbers) -> ModuleAxes:
        """TP on attention (and on the dense layers' MLP, if any); no sequence parallelism inside TP
        (transformers adds each DeepStack feature between decoder layers by boolean indexing over the
        whole sequence); the experts are split by EP (their count from the typed blocks)."""
        return base.decoder_axes(n, sequence_parallel=False, mlp=n.sparse_layers < n.layers)


ARCH = Qwen3VLArch()
