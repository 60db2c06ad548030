"""Qwen3.5, dense and MoE, as a :class:`~dhp.models.family.ModelFamily`: ``vision`` -> ``image_embeds`` -> ``llm``.

Everything but its declarations is the Qwen3 base (``dhp/models/qwen3_base/base_family.py``): one edge
``image_embeds`` (the encoder has no DeepStack), the SP cut, configs, modules and checkpoint keys. Here:
each flavour's transformers config (``Qwen3_5Config`` / ``Qwen3_5MoeConfig``), the hybrid decoder's own
``text_config`` keys and its TP plan (``tp.py``). The MoE flavour (declared by
``model.llm.extra.num_experts``, a ``qwen3_5_moe`` checkpoint) has in every layer a sparse MoE block
(router, routed experts, gated shared expert).

The released MoE checkpoints store one tensor per expert (``...mlp.experts.{j}.gate_proj.weight`` ...),
which transformers 5 fuses on load; dhp's loader reads both that layout and the fused one: the Qwen3
base declares the fold (``qwen3_base.base_family.MOE_EXPERT_FOLDS``) and an EP rank reads only its own
experts' tensors (``dhp.models.loading``). The release also stores a multi-token-prediction head
(``mtp.*``), which transformers' ``Qwen3_5ForConditionalGeneration`` ignores on load; it is not part of
the module graph either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from transformers import Qwen3_5Config, Qwen3_5MoeConfig

from dhp.models.qwen3_5.arch import ARCH, Numbers
from dhp.models.qwen3_5.tp import llm_tp_plan, moe_llm_tp_plan
from dhp.models.qwen3_base.base_family import Qwen3Family
from dhp.models.qwen3_base.config import text_config

#: the release's multi-token-prediction head (``mtp.*``): owned by ``mtp``, a module this graph never
#: builds (transformers' Qwen3_5ForConditionalGeneration drops these keys on load too), so loading reads
#: them into no module instead of refusing the released directory
MTP_PREFIX, MTP_MODULE = "mtp.", "mtp"


class Qwen3_5Family(Qwen3Family):
    """Qwen3.5: ``vision`` (ViT + merger) feeds ``image_embeds`` to the hybrid ``llm`` (dense or MoE)."""

    name = "qwen3_5"
    arch = ARCH
    linear_attention = "language_model.layers.*.linear_attn"  # the Gated DeltaNet layers
    configs: ClassVar[Mapping[str, tuple[type, str]]] = {
        "qwen3_5": (Qwen3_5Config, "Qwen3_5ForConditionalGeneration"),
        "qwen3_5_moe": (Qwen3_5MoeConfig, "Qwen3_5MoeForConditionalGeneration"),
    }

    def text_config(self, n: Numbers) -> dict[str, Any]:
        """The hybrid layers and the DeltaNet sizes; the dense SwiGLU width, or the shared expert's
        (``output_router_logits`` stays transformers' default false: the LLM module asks for the logits)."""
        mlp = "shared_expert_intermediate_size" if n.moe else "intermediate_size"
        return text_config(n, partial_rotary_factor=n.partial_rotary_factor) | {
            "layer_types": list(n.layer_types),
            mlp: n.mlp,
            "linear_num_key_heads": n.linear_k_heads,
            "linear_num_value_heads": n.linear_v_heads,
            "linear_key_head_dim": n.linear_k_dim,
            "linear_value_head_dim": n.linear_v_dim,
            "linear_conv_kernel_dim": n.conv_kernel,
        }

    def llm_tp(self, n: Numbers) -> Callable[[bool], Mapping[str, Any]]:
        """The hybrid decoder's plan (with sequence parallelism inside TP), or the MoE flavour's."""
        return (lambda sequence_parallel: moe_llm_tp_plan()) if n.moe else llm_tp_plan

    def checkpoint_owner(self, key: str) -> tuple[str, str] | None:
        """Checkpoint key -> ``(module_name, module_fqn)``; None if no module owns it. The release's
        ``mtp.*`` keys belong to ``mtp``, which is not in ``module_names``: no module loads them."""
        if key.startswith(MTP_PREFIX):
            return MTP_MODULE, key[len(MTP_PREFIX) :]
        return super().checkpoint_owner(key)


FAMILY = Qwen3_5Family
