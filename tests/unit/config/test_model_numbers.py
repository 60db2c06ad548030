"""Pin the published Qwen2.5-VL architecture numbers of conf/model/*.yaml.

Source: the config.json of Qwen/Qwen2.5-VL-{3B,7B,32B,72B}-Instruct on the hub (the vision
encoder is the same for all four; vision_config.out_hidden_size equals the LLM hidden size).
transformers' ``Qwen2_5_VLConfig()`` defaults are the 72B numbers, and are checked too.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from dhp.config.loader import CONF_DIR

pytestmark = pytest.mark.unit

# hidden, layers, heads, kv heads, MLP, vocab, tied embeddings
PUBLISHED = {
    "qwen_vl_3b": (2048, 36, 16, 2, 11008, 151936, True),
    "qwen_vl_7b": (3584, 28, 28, 4, 18944, 152064, False),
    "qwen_vl_32b": (5120, 64, 40, 8, 27648, 152064, False),
    "qwen_vl_72b": (8192, 80, 64, 8, 29568, 152064, False),
}
VISION = {
    "depth": 32,
    "hidden_size": 1280,
    "num_heads": 16,
    "intermediate_size": 3420,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
    "extra": {"window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]},
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_numbers(name: str) -> None:
    cfg = OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")
    lm = cfg.llm
    got = (
        lm.hidden_size,
        lm.num_layers,
        lm.num_heads,
        lm.num_kv_heads,
        lm.intermediate_size,
        lm.vocab_size,
        lm.tie_word_embeddings,
    )
    assert got == PUBLISHED[name]
    assert OmegaConf.to_container(cfg.vision) == VISION
    assert list(lm.extra.mrope_section) == [16, 24, 24]
    assert lm.rope_theta == 1_000_000.0
    assert lm.rms_norm_eps == 1e-6
    assert lm.max_position_embeddings == 128000


def test_72b_matches_transformers_defaults() -> None:
    from transformers import Qwen2_5_VLConfig

    ref = Qwen2_5_VLConfig()
    t, v = ref.text_config, ref.vision_config
    assert PUBLISHED["qwen_vl_72b"][:6] == (
        t.hidden_size,
        t.num_hidden_layers,
        t.num_attention_heads,
        t.num_key_value_heads,
        t.intermediate_size,
        t.vocab_size,
    )
    # (transformers' default vision out_hidden_size is 3584, the 7B's; the hub's 72B sets 8192.)
    for key in (
        "depth",
        "num_heads",
        "intermediate_size",
        "patch_size",
        "spatial_merge_size",
        "temporal_patch_size",
        "in_channels",
    ):
        assert getattr(v, key) == VISION[key], key
    assert v.window_size == VISION["extra"]["window_size"]
    assert list(v.fullatt_block_indexes) == VISION["extra"]["fullatt_block_indexes"]
