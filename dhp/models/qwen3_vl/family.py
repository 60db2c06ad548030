"""Qwen3-VL, dense and MoE, as a :class:`~dhp.models.family.ModelFamily`: ``vision`` -> 1 + K edges -> ``llm``.

A declaration on the Qwen3 base (``dhp/models/qwen3_base/base_family.py``: the edges ``image_embeds``
and one ``deepstack_embeds_k`` per DeepStack level, the SP cut, configs, modules, checkpoint keys, the
Qwen3 decoder's ``text_config`` and TP plan): each flavour's transformers config, and the released MoE
checkpoints' expert layout. The flavour is the numbers' (``model.llm.extra.num_experts``, ``arch.py``);
``get_family("qwen3_vl_moe")`` is this family held to its MoE flavour.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

from dhp.models.qwen3_base.base_family import Qwen3Family, transposed_experts
from dhp.models.qwen3_vl.arch import ARCH


class Qwen3VLFamily(Qwen3Family):
    """Qwen3-VL: ``vision`` (ViT + merger + DeepStack mergers) feeds 1 + K tensors to ``llm`` (dense or MoE)."""

    name = "qwen3_vl"
    arch = ARCH
    configs: ClassVar[Mapping[str, tuple[type, str]]] = {
        "qwen3_vl": (Qwen3VLConfig, "Qwen3VLForConditionalGeneration"),
        "qwen3_vl_moe": (Qwen3VLMoeConfig, "Qwen3VLMoeForConditionalGeneration"),
    }

    def stored_dims(
        self, fqn: str, stored_shape: tuple[int, ...], shape: tuple[int, ...]
    ) -> tuple[int, ...] | None:
        """The released MoE checkpoints' experts, [E, H, 2I] / [E, I, H]: transposed on load."""
        return transposed_experts(fqn, stored_shape, shape)


FAMILY = Qwen3VLFamily
