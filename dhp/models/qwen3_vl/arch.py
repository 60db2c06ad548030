"""Qwen3-VL architecture numbers: the tiny test model, validation, and the transformers config.

The schema's ``model.vision`` / ``model.llm`` blocks carry the numbers every Qwen-style VLM has
(depth, widths, heads, vocab, ...). Qwen3-VL adds its own, kept under ``model.arch`` and checked here
(:func:`arch_issues`), so the family needs no schema edit:

- ``arch.vision``: ``num_position_embeddings`` (the learned position table, a square grid resampled
  bilinearly to each image's patch grid), ``deepstack_visual_indexes`` (encoder layers whose merged
  features are added to the LLM's first hidden states), ``hidden_act``;
- ``arch.llm``: ``head_dim`` (not ``hidden / heads`` in the 32B), ``hidden_act``, ``mrope_interleaved``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Qwen3VLConfig

from dhp.errors import ConfigError, ConfigIssue

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

VISION_KEYS = ("num_position_embeddings", "deepstack_visual_indexes", "hidden_act")
LLM_KEYS = ("head_dim", "hidden_act", "mrope_interleaved")

#: The tiny test architecture: seconds on CPU, every Qwen3-VL feature present (patch 16, a learned
#: 4x4 position table interpolated to each grid, full attention in every block, 2 DeepStack levels,
#: interleaved M-RoPE touching all three axes, head_dim set explicitly).
TINY_VISION = {
    "depth": 3,
    "hidden_size": 32,
    "num_heads": 4,
    "intermediate_size": 64,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
}
TINY_LLM = {
    "hidden_size": 64,
    "num_layers": 3,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 1024,
    "tie_word_embeddings": False,
    "rope_theta": 5000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 128000,
    "mrope_section": [2, 3, 3],
}
TINY_ARCH = {
    "vision": {
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0, 1],
        "hidden_act": "gelu_pytorch_tanh",
    },
    "llm": {"head_dim": 16, "hidden_act": "silu", "mrope_interleaved": True},
}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; a ConfigError for anything else."""
    if name not in DTYPES:
        raise ConfigError(
            [
                ConfigIssue(
                    "model.dtype", name, f"unknown dtype; known: {sorted(DTYPES)}", "use float32 or bfloat16"
                )
            ]
        )
    return DTYPES[name]


def _issue(path: str, value: Any, rule: str, fix: str) -> ConfigIssue:
    return ConfigIssue(path=path, value=value, rule=rule, fix=fix)


def arch_issues(
    vision: Mapping[str, Any], llm: Mapping[str, Any], arch: Mapping[str, Any]
) -> list[ConfigIssue]:
    """Every problem with Qwen3-VL's architecture numbers (empty when they build a valid model)."""
    issues: list[ConfigIssue] = []
    for part, keys in (("vision", VISION_KEYS), ("llm", LLM_KEYS)):
        have = dict(arch[part]) if part in arch else {}
        missing = [k for k in keys if k not in have]
        extra = sorted(set(have) - set(keys))
        if missing or extra:
            issues.append(
                _issue(
                    f"model.arch.{part}",
                    sorted(have),
                    f"qwen3_vl needs exactly {list(keys)} here (missing {missing}, unknown {extra})",
                    "copy the block from conf/model/qwen3_vl_8b.yaml",
                )
            )
    if issues:
        return issues
    av, al = arch["vision"], arch["llm"]
    side = math.isqrt(int(av["num_position_embeddings"]))
    if side * side != av["num_position_embeddings"]:
        issues.append(
            _issue("model.arch.vision.num_position_embeddings", av["num_position_embeddings"],
                   "must be a square (the learned position grid is side x side)", "use e.g. 2304 = 48 * 48")
        )  # fmt: skip
    levels = list(av["deepstack_visual_indexes"])
    if len(set(levels)) != len(levels) or any(not 0 <= i < vision["depth"] for i in levels):
        issues.append(
            _issue("model.arch.vision.deepstack_visual_indexes", levels,
                   f"must be distinct encoder layer indexes in [0, depth={vision['depth']})", "e.g. [8, 16, 24]")
        )  # fmt: skip
    if len(levels) > llm["num_layers"]:
        issues.append(
            _issue("model.arch.vision.deepstack_visual_indexes", levels,
                   f"{len(levels)} DeepStack levels but the LLM has {llm['num_layers']} layers (one level per layer)",
                   "use at most llm.num_layers levels")
        )  # fmt: skip
    if "fullatt_block_indexes" in vision and list(vision["fullatt_block_indexes"]) != list(
        range(vision["depth"])
    ):
        issues.append(
            _issue("model.vision.fullatt_block_indexes", list(vision["fullatt_block_indexes"]),
                   "Qwen3-VL has full attention in every encoder block", f"list all blocks: 0..{vision['depth'] - 1}")
        )  # fmt: skip
    if vision["hidden_size"] % vision["num_heads"]:
        issues.append(
            _issue("model.vision.num_heads", vision["num_heads"],
                   f"must divide vision.hidden_size={vision['hidden_size']}", "pick a divisor")
        )  # fmt: skip
    if llm["num_heads"] % llm["num_kv_heads"]:
        issues.append(
            _issue("model.llm.num_kv_heads", llm["num_kv_heads"],
                   f"must divide llm.num_heads={llm['num_heads']}", "pick a divisor")
        )  # fmt: skip
    if sum(llm["mrope_section"]) * 2 != al["head_dim"] or len(llm["mrope_section"]) != 3:
        issues.append(
            _issue("model.llm.mrope_section", list(llm["mrope_section"]),
                   f"must be 3 numbers summing to head_dim / 2 = {al['head_dim'] // 2}", "e.g. [24, 20, 20] for 128")
        )  # fmt: skip
    if not al["mrope_interleaved"]:
        issues.append(
            _issue("model.arch.llm.mrope_interleaved", al["mrope_interleaved"],
                   "Qwen3-VL's rotary embedding is always interleaved", "set it to true")
        )  # fmt: skip
    return issues


def build_hf_config(
    *,
    vision: Mapping[str, Any],
    llm: Mapping[str, Any],
    arch: Mapping[str, Any],
    tokens: Mapping[str, int],
    dtype: torch.dtype,
    attn_implementation: str,
) -> Qwen3VLConfig:
    """The transformers config from validated numbers (a ConfigError lists every problem)."""
    issues = arch_issues(vision, llm, arch)
    if issues:
        raise ConfigError(issues)
    av, al = arch["vision"], arch["llm"]
    return Qwen3VLConfig(
        vision_config=dict(
            depth=vision["depth"],
            hidden_size=vision["hidden_size"],
            num_heads=vision["num_heads"],
            intermediate_size=vision["intermediate_size"],
            patch_size=vision["patch_size"],
            spatial_merge_size=vision["spatial_merge_size"],
            temporal_patch_size=vision["temporal_patch_size"],
            in_channels=vision["in_channels"],
            out_hidden_size=llm["hidden_size"],
            num_position_embeddings=av["num_position_embeddings"],
            deepstack_visual_indexes=list(av["deepstack_visual_indexes"]),
            hidden_act=av["hidden_act"],
        ),
        text_config=dict(
            vocab_size=llm["vocab_size"],
            hidden_size=llm["hidden_size"],
            num_hidden_layers=llm["num_layers"],
            num_attention_heads=llm["num_heads"],
            num_key_value_heads=llm["num_kv_heads"],
            head_dim=al["head_dim"],
            hidden_act=al["hidden_act"],
            intermediate_size=llm["intermediate_size"],
            rms_norm_eps=llm["rms_norm_eps"],
            max_position_embeddings=llm["max_position_embeddings"],
            rope_parameters={
                "rope_type": "default",
                "rope_theta": llm["rope_theta"],
                "mrope_section": list(llm["mrope_section"]),
                "mrope_interleaved": bool(al["mrope_interleaved"]),
            },
            bos_token_id=tokens["bos_token_id"],
            eos_token_id=tokens["eos_token_id"],
            pad_token_id=tokens["pad_token_id"],
        ),
        image_token_id=tokens["image_token_id"],
        video_token_id=tokens["video_token_id"],
        vision_start_token_id=tokens["vision_start_token_id"],
        vision_end_token_id=tokens["vision_end_token_id"],
        tie_word_embeddings=llm["tie_word_embeddings"],
        attn_implementation=attn_implementation,
        dtype=dtype,
    )
