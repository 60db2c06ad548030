"""Qwen3-VL's architecture, dense and MoE flavours, without torch (``ARCH``): a declaration.

Qwen3-VL is the Qwen3 vision encoder with DeepStack (``dhp/models/qwen3_vision``: encoder blocks whose
merged features are added to the LLM's hidden states after layers 0, 1, ...) feeding the Qwen3 decoder
(``dhp/models/qwen3_base/decoder.py``: numbers, checks, counts, typed blocks, axes). Two flavours, one
code path: dense (``qwen3_vl``: Qwen3-VL-8B/32B) and MoE (``qwen3_vl_moe``: Qwen3-VL-30B-A3B and
235B-A22B; declared by ``model.llm.extra.num_experts``, or by ``model.family: qwen3_vl_moe``).

``model.vision.extra``: ``num_position_embeddings``, ``deepstack_visual_indexes``, ``hidden_act``.
``model.llm.extra``: ``head_dim`` (not ``hidden / heads`` in the 32B), ``hidden_act``, ``mrope_section``,
``mrope_interleaved``; the MoE flavour adds ``num_experts`` (E), ``num_experts_per_tok`` (top-k),
``moe_intermediate_size`` (I), ``router_aux_loss_coef`` (weight of the load-balancing loss added to the
LM loss), ``decoder_sparse_step``, ``mlp_only_layers`` and ``norm_topk_prob``.
"""

from __future__ import annotations

from dhp.models.arch import Capabilities
from dhp.models.qwen3_base.arch import Flavour
from dhp.models.qwen3_base.decoder import Qwen3DecoderArch
from dhp.models.qwen3_vision.arch import vision_tp_sharded

#: What this family's runtime does exactly. Packing, in both flavours (per-sample positions, attention
#: kept inside each sample, DeepStack at the packed image tokens, the router over the same tokens:
#: tests/parity/test_packing.py). Video is not declared (no video parity test), so validation refuses
#: video data for this family.
CAPABILITIES = Capabilities(
    packing=True,
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


class Qwen3VLArch(Qwen3DecoderArch):
    """:class:`dhp.models.arch.FamilyArch` of Qwen3-VL (reads ``model.vision.extra`` / ``model.llm.extra``)."""

    dense = Flavour("qwen3_vl", example="qwen3_vl_8b")
    moe = Flavour("qwen3_vl_moe", example="qwen3_vl_30b_a3b")
    display = "Qwen3-VL"
    capabilities = CAPABILITIES
    deepstack = True


ARCH = Qwen3VLArch()
