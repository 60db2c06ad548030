"""Qwen2.5-VL's parallel plans by FQN: what ``dhp.parallel`` shards in each module, and where SP attends.

Encoder: TP styles per Linear (the fused ``qkv`` needs :class:`FusedColwiseParallel`, the MLP width
3420 is uneven at TP=8: :class:`UnevenRowwiseParallel`); Ulysses SP only on the full-attention blocks
(``fullatt_block_indexes``): window blocks attend inside windows that an SP cut never splits
(``sp_shard``), so they run locally. LLM: the usual decoder plan under ``language_model`` + ``lm_head``.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLTextConfig

from dhp.models.axes import runtime_plan
from dhp.models.family import AttentionSite, ModuleParallelPlan
from dhp.models.qwen2_5_vl.arch import llm_axes, vision_axes
from dhp.parallel.llm_tp import decoder_tp_plan
from dhp.parallel.vision_tp import FusedColwiseParallel, UnevenRowwiseParallel


def vision_tp_plan() -> dict[str, ParallelStyle]:
    """The encoder TP plan: module FQN glob -> DTensor style (one FQN atom per ``*``).

    Every ``nn.Linear`` of the encoder matches exactly one glob (tested); ``patch_embed.proj`` (Conv3d),
    the norms and ``merger.ln_q`` are left replicated.
    """
    return {
        "visual.blocks.*.attn.qkv": FusedColwiseParallel(num_chunks=3),
        "visual.blocks.*.attn.proj": RowwiseParallel(),
        "visual.blocks.*.mlp.gate_proj": ColwiseParallel(),
        "visual.blocks.*.mlp.up_proj": ColwiseParallel(),
        "visual.blocks.*.mlp.down_proj": UnevenRowwiseParallel(),
        "visual.merger.mlp.0": ColwiseParallel(),
        "visual.merger.mlp.2": RowwiseParallel(),
    }


def llm_tp_plan(*, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The LLM TP plan (``language_model`` decoder + ``lm_head``), with SP inside TP when asked."""
    return decoder_tp_plan(model="language_model", lm_head="lm_head", sequence_parallel=sequence_parallel)


def parallel_plan(
    name: str, hf_config: Qwen2_5_VLConfig | Qwen2_5_VLTextConfig, *, tied: dict[str, str]
) -> ModuleParallelPlan:
    """Encoder: TP by FQN, SP on the full-attention blocks. LLM: decoder TP (+ SP inside TP), the loss.
    What each degree must divide is the declared axes' (``arch.vision_axes`` / ``arch.llm_axes``)."""
    if name == "vision":
        v = hf_config.vision_config
        return runtime_plan(
            vision_axes(heads=v.num_heads, hidden=v.hidden_size, merge=v.spatial_merge_size),
            blocks=("visual.blocks.*",),
            tp=lambda sequence_parallel: vision_tp_plan(),
            tp_heads=("visual.blocks.*.attn",),
            sp=tuple(AttentionSite(f"visual.blocks.{i}.attn") for i in v.fullatt_block_indexes),
        )
    t = hf_config.text_config if isinstance(hf_config, Qwen2_5_VLConfig) else hf_config
    axes = llm_axes(
        heads=t.num_attention_heads,
        kv_heads=t.num_key_value_heads,
        vocab=t.vocab_size,
        mlp=t.intermediate_size,
        layers=t.num_hidden_layers,
        tied=bool(tied),  # the family's tied parameters (lm_head -> embed_tokens)
    )
    return runtime_plan(
        axes,
        blocks=("language_model.layers.*",),
        tp=lambda sequence_parallel: llm_tp_plan(sequence_parallel=sequence_parallel),
        loss=True,
        tied=tied,
        pad_token_id=t.pad_token_id,
    )
