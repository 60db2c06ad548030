"""Encoder numbers <-> a transformers Qwen3-style vision config (both directions), for any family.

Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 name their vision config classes differently but give them the same
fields (Qwen3.5's has no ``deepstack_visual_indexes``); the family builds its own config class from
:func:`vision_config_kwargs` and reads one back with :func:`vision_numbers_from_hf`.
"""

from __future__ import annotations

from typing import Any

from dhp.models.qwen3_vision.arch import VisionNumbers


def vision_config_kwargs(n: VisionNumbers, *, deepstack: bool) -> dict[str, Any]:
    """The ``vision_config`` keyword arguments of validated numbers (every merger projects to ``out_hidden``).

    ``deepstack``: whether the family's vision config has ``deepstack_visual_indexes`` at all."""
    kwargs: dict[str, Any] = dict(
        depth=n.depth,
        hidden_size=n.hidden,
        num_heads=n.heads,
        intermediate_size=n.mlp,
        patch_size=n.patch_size,
        spatial_merge_size=n.merge,
        temporal_patch_size=n.temporal_patch_size,
        in_channels=n.in_channels,
        out_hidden_size=n.out_hidden,
        num_position_embeddings=n.num_position_embeddings,
        hidden_act=n.act,
    )
    if deepstack:
        kwargs["deepstack_visual_indexes"] = list(n.deepstack)
    return kwargs


def vision_numbers_from_hf(v: Any, *, deepstack: bool) -> VisionNumbers:
    """The numbers of a transformers vision config (a HF directory's ``config.json``)."""
    return VisionNumbers(
        depth=v.depth,
        hidden=v.hidden_size,
        heads=v.num_heads,
        mlp=v.intermediate_size,
        patch_size=v.patch_size,
        merge=v.spatial_merge_size,
        temporal_patch_size=v.temporal_patch_size,
        in_channels=v.in_channels,
        num_position_embeddings=v.num_position_embeddings,
        deepstack=tuple(v.deepstack_visual_indexes) if deepstack else (),
        act=v.hidden_act,
        out_hidden=v.out_hidden_size,
    )
