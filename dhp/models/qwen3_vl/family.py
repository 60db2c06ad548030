"""Qwen3-VL, dense and MoE, as a :class:`~dhp.models.family.ModelFamily`: ``vision`` -> 1 + K edges -> ``llm``.

Everything but its declarations is the Qwen3 base (``dhp/models/qwen3_base/base_family.py``): the edges
``image_embeds`` and one ``deepstack_embeds_k`` per DeepStack level, the SP cut, configs, modules and
checkpoint keys. Here: each flavour's transformers config (``Qwen3VLConfig`` / ``Qwen3VLMoeConfig``),
the decoder's own ``text_config`` keys, its TP plan (``tp.py``) and the released MoE checkpoints' expert
layout. The flavour is the numbers' (``model.llm.extra.num_experts``, ``arch.py``);
``get_family("qwen3_vl_moe")`` is this family held to its MoE flavour.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

from dhp.models.qwen3_base.base_family import Qwen3Family, transposed_experts
from dhp.models.qwen3_base.config import text_config
from dhp.models.qwen3_vl.arch import ARCH, Numbers
from dhp.models.qwen3_vl.tp import llm_tp_plan


class Qwen3VLFamily(Qwen3Family):
    """Qwen3-VL: ``vision`` (ViT + merger + DeepStack mergers) feeds 1 + K tensors to ``llm`` (dense or MoE)."""

    name = "qwen3_vl"
    arch = ARCH
    configs: ClassVar[Mapping[str, tuple[type, str]]] = {
        "qwen3_vl": (Qwen3VLConfig, "Qwen3VLForConditionalGeneration"),
        "qwen3_vl_moe": (Qwen3VLMoeConfig, "Qwen3VLMoeForConditionalGeneration"),
    }

    def text_config(self, n: Numbers) -> dict[str, Any]:
        """The decoder's dense width; the MoE flavour's sparse pattern (``output_router_logits``
        stays transformers' default, false as released: the LLM module asks for the logits itself)."""
        kwargs = text_config(n) | dict(intermediate_size=n.mlp)
        if n.moe:  # as released; transformers' router always renormalises
            kwargs |= dict(
                decoder_sparse_step=n.sparse_step, mlp_only_layers=list(n.mlp_only), norm_topk_prob=True
            )
        return kwargs

    def llm_tp(self, n: Numbers) -> Callable[[bool], Mapping[str, Any]]:
        dense = n.sparse_layers < n.layers
        return lambda sequence_parallel: llm_tp_plan(dense_mlp=dense)

    def stored_dims(
        self, fqn: str, stored_shape: tuple[int, ...], shape: tuple[int, ...]
    ) -> tuple[int, ...] | None:
        """The released MoE checkpoints' experts, [E, H, 2I] / [E, I, H]: transposed on load."""
        return transposed_experts(fqn, stored_shape, shape)


FAMILY = Qwen3VLFamily
