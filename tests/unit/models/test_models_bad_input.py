"""Bad input at the encoder/LLM cut: typed DataErrors naming the sample and both counts; no state leaks."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2_5_VLTextConfig

from dhp.errors import DataError
from dhp.models import get_family
from dhp.models.testing import modules_from_reference, tiny_vl_batch

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def setup():
    family = get_family("qwen2_5_vl")
    hf_config = family.hf_config(family.tiny_model_config())
    torch.manual_seed(0)
    modules = modules_from_reference(family, family.reference_model(hf_config), hf_config)
    return hf_config, modules["vision"], modules["llm"]


def _llm_kwargs(batch, embeds):
    return dict(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        labels=batch["labels"],
        mm_token_type_ids=batch["mm_token_type_ids"],
        image_grid_thw=batch["image_grid_thw"],
        image_embeds=embeds,
        sample_ids=batch["sample_ids"],
    )


def test_fewer_embeddings_than_image_tokens_names_sample_and_counts(setup):
    hf_config, vision, llm = setup
    batch = tiny_vl_batch(hf_config, images=[[(4, 4)], [(8, 6)]], text_lens=[3, 3])
    embeds = vision(batch["pixel_values"], batch["image_grid_thw"])["image_embeds"].detach()
    # the data side dropped 2 image tokens of sample 1 (12 -> 10) but kept its grid: never truncate
    ids = batch["input_ids"].clone()
    pos = (ids[1] == hf_config.image_token_id).nonzero().flatten()[:2]
    ids[1, pos] = 50
    bad = dict(batch, input_ids=ids, mm_token_type_ids=(ids == hf_config.image_token_id).long())
    with pytest.raises(DataError, match=r"sample synthetic:0:1: 10 image tokens .* but 12 image embeddings"):
        llm(**_llm_kwargs(bad, embeds))


def test_embedding_rows_must_match_the_grids(setup):
    hf_config, vision, llm = setup
    batch = tiny_vl_batch(hf_config, images=[[(4, 4)]], text_lens=[3])
    embeds = vision(batch["pixel_values"], batch["image_grid_thw"])["image_embeds"].detach()
    with pytest.raises(DataError, match=r"describes 4 image embeddings but 3 were given"):
        llm(**_llm_kwargs(batch, embeds[:3]))


def test_image_tokens_without_embeddings(setup):
    hf_config, _, llm = setup
    batch = tiny_vl_batch(hf_config, images=[[(4, 4)]], text_lens=[3])
    with pytest.raises(DataError, match=r"describes 4 image embeddings but 0 were given"):
        llm(**_llm_kwargs(batch, None))


def test_image_without_tokens(setup):
    hf_config, vision, llm = setup
    batch = tiny_vl_batch(hf_config, images=[[(4, 4)], [(4, 4)]], text_lens=[3, 3])
    embeds = vision(batch["pixel_values"], batch["image_grid_thw"])["image_embeds"].detach()
    text = tiny_vl_batch(hf_config, images=[[(4, 4)], []], text_lens=[3, 9])
    bad = dict(text, image_grid_thw=batch["image_grid_thw"])
    with pytest.raises(DataError, match=r"images \[1\] have no tokens"):
        llm(**_llm_kwargs(bad, embeds))


def test_token_types_must_agree_with_ids(setup):
    hf_config, vision, llm = setup
    batch = tiny_vl_batch(hf_config, images=[[(4, 4)]], text_lens=[3])
    embeds = vision(batch["pixel_values"], batch["image_grid_thw"])["image_embeds"].detach()
    types = batch["mm_token_type_ids"].clone()
    types[0, 0] = 1
    with pytest.raises(DataError, match=r"sample synthetic:0:0: 4 image tokens .* but 5 positions marked"):
        llm(**_llm_kwargs(dict(batch, mm_token_type_ids=types), embeds))


def test_vision_inputs_are_checked(setup):
    hf_config, vision, _ = setup
    batch = tiny_vl_batch(hf_config, images=[[(4, 4)]], text_lens=[3])
    with pytest.raises(DataError, match=r"has 16 patch rows but image_grid_thw \[\[1, 4, 6\]\] describes 24"):
        vision(batch["pixel_values"], torch.tensor([[1, 4, 6]]))
    with pytest.raises(DataError, match="not divisible by spatial_merge_size=2"):
        vision(batch["pixel_values"][:15], torch.tensor([[1, 3, 5]]))
    with pytest.raises(DataError, match=r"expects \(N_patches, 1176\)"):
        vision(batch["pixel_values"][:, :100], batch["image_grid_thw"])


def test_image_for_a_text_only_config_is_an_error():
    family = get_family("qwen2_5_vl")
    text_cfg = Qwen2_5_VLTextConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]},
    )
    llm = family.build_module("llm", text_cfg, device="cpu", dtype=torch.float32)
    ids = torch.randint(20, 64, (1, 8))
    ones = torch.ones_like(ids)
    out = llm(
        input_ids=ids, attention_mask=ones, labels=ids, mm_token_type_ids=None, sample_ids=["a.jsonl:3"]
    )
    assert out.num_tokens == 7 and torch.isfinite(out.loss_sum)
    types = torch.zeros_like(ids)
    types[0, 2:4] = 1
    with pytest.raises(DataError, match=r"text-only .*samples with image tokens: \['a.jsonl:3'\]"):
        llm(input_ids=ids, attention_mask=ones, labels=ids, mm_token_type_ids=types, sample_ids=["a.jsonl:3"])
    with pytest.raises(DataError, match="text-only"):
        llm(
            input_ids=ids,
            attention_mask=ones,
            labels=ids,
            mm_token_type_ids=None,
            image_embeds=torch.zeros(2, 32),
        )


def test_no_state_leaks_between_calls(setup):
    """No rope_deltas (or any) state: a call's result does not depend on the call before it."""
    hf_config, vision, llm = setup
    a = tiny_vl_batch(hf_config, images=[[(8, 6)]], text_lens=[4], seed=1)
    b = tiny_vl_batch(hf_config, images=[[], [(4, 4)]], text_lens=[20, 2], seed=2)
    with torch.no_grad():
        ea, eb = (vision(x["pixel_values"], x["image_grid_thw"])["image_embeds"] for x in (a, b))
        first = llm(**_llm_kwargs(b, eb)).loss_sum
        llm(**_llm_kwargs(a, ea))
        again = llm(**_llm_kwargs(b, eb)).loss_sum
    assert torch.equal(first, again)
    assert not any("rope_deltas" in name for name in vars(llm))
