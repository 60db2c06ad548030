"""The Qwen3 decoder as a family declares it by default, without torch: every layer causal GQA attention
and a dense SwiGLU MLP, or in the MoE flavour a sparse block by Qwen3-MoE's rule.

:class:`Qwen3DecoderArch` is :class:`~dhp.models.qwen3_base.arch.Qwen3Arch` with every hook written for
this decoder (transformers' ``Qwen3VLTextModel`` / ``Qwen3VLMoeTextModel`` and their kin): a family on it
declares only its flavours, name, capabilities, encoder kind and ``extra`` keys (``qwen3_vl/arch.py``).

- dense flavour: every decoder layer has a SwiGLU MLP of ``model.llm.intermediate_size``;
- MoE flavour (``model.llm.extra.num_experts``): decoder layer ``i`` is sparse (a top-k router [E, H],
  E experts of ``moe_intermediate_size`` as 3-D ``experts.gate_up_proj`` [E, 2I, H] /
  ``experts.down_proj`` [E, H, I]) unless ``i`` is in ``mlp_only_layers`` or ``(i + 1) %
  decoder_sparse_step != 0``; the other layers are dense SwiGLUs. ``norm_topk_prob``: transformers'
  router always renormalises the top-k probabilities, so only ``true`` builds the model it runs.

Counts: ``tp_sharded`` attention q/k/v/o, the dense layers' gate/up/down, vocab-parallel embeddings and
lm_head; ``replicated`` norms, q_norm/k_norm and each sparse layer's router (EP replicates it, TP does not
shard it); ``expert`` ``3 * E * I * H`` per sparse layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dhp.config.issues import Issues
from dhp.models.arch import Block, ModuleArch, ModuleAxes, ParamCount
from dhp.models.qwen3_base import arch as base
from dhp.models.qwen3_base.config import text_numbers_from_hf

#: the MoE flavour's sparse-layer pattern in ``model.llm.extra`` (beside ``base.MOE_EXTRA``)
SPARSE_EXTRA = ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")


@dataclass(frozen=True, kw_only=True)
class DecoderNumbers(base.TextNumbers):
    """The numbers of a Qwen3 decoder: the shared ones, its layer count and the sparse-layer pattern."""

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


def layer_params(n: DecoderNumbers) -> list[ParamCount]:
    """Each decoder layer: attention, the two norms and its MLP (sparse block or dense SwiGLU)."""
    attention = base.attention_params(n)
    return [attention + base.mlp_params(n, sparse=n.is_sparse(i)) for i in range(n.layers)]


class Qwen3DecoderArch(base.Qwen3Arch):
    """A Qwen3-style family whose LLM is the Qwen3 decoder (dense, or sparse by Qwen3-MoE's rule)."""

    llm_extra = ("head_dim", "hidden_act", "mrope_interleaved", "mrope_section")
    moe_extra = (*base.MOE_EXTRA, *SPARSE_EXTRA)

    def numbers(self, model: Any) -> DecoderNumbers:
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
        numbers = base.text_numbers(model, deepstack=self.deepstack)
        return DecoderNumbers(**numbers, layers=model.llm.num_layers, **sparse)

    def numbers_from_hf(self, cfg: Any) -> DecoderNumbers:
        """``norm_topk_prob`` is true whatever the file says: it is what transformers' router computes."""
        t, moe = cfg.text_config, cfg.model_type == self.moe.name
        sparse = dict(sparse_step=t.decoder_sparse_step, mlp_only=tuple(t.mlp_only_layers)) if moe else {}
        return DecoderNumbers(
            **text_numbers_from_hf(cfg, deepstack=self.deepstack, moe=moe),
            mlp=t.intermediate_size,
            layers=t.num_hidden_layers,
            **sparse,
        )

    def check_raw(self, model: Any, issues: Issues) -> None:
        """The sparse-layer pattern (MoE flavour): a positive step, decoder layer indexes."""
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

    def check_numbers(self, n: DecoderNumbers, issues: Issues) -> None:
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
            f"train it as the dense flavour (no MoE keys, model.family: {self.dense.name}), or leave a "
            "layer sparse",
        )
        issues.check(
            n.norm_topk_prob,
            f"{p}.norm_topk_prob",
            n.norm_topk_prob,
            f"transformers' {self.display} MoE router always renormalises the top-k probabilities",
            "set it to true",
        )

    def llm_arch(self, n: DecoderNumbers) -> ModuleArch:
        """Per decoder layer causal GQA attention and the sparse MLP (``Mlp(kind="moe")``: E experts of
        I, top-k active, no shared expert) or the dense SwiGLU. The router's ``E*H`` MACs per token and
        sparse layer are left out of ``block_macs`` (2 % of the experts' in Qwen3-VL-30B-A3B)."""
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

    def llm_axes(self, n: DecoderNumbers) -> ModuleAxes:
        """TP on attention (and on the dense layers' MLP, if any); no Megatron sequence parallelism
        inside TP (Qwen3-VL's DeepStack adds its features between decoder layers by boolean indexing
        over the whole sequence, and no parity test covers this decoder with it); the experts are split
        by EP (their count from the typed blocks)."""
        return base.decoder_axes(
            n, sequence_parallel=False, mlp=n.sparse_layers < n.layers, context_parallel=True
        )
