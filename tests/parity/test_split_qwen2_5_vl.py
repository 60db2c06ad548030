"""The Qwen2.5-VL module cut (vision -> image_embeds -> llm) against the untouched transformers model.

fp32 on CPU. Tolerance: loss and every parameter's gradient within 5e-6 relative
(max|split - ref| / max|ref|). The cut itself is bit-exact (the same ops in the same order); the
split side's loss is dhp's chunked cross-entropy (softmax gradient as exp(logit - lse), summed per
chunk), which differs from HF's log-softmax in the last bits: measured up to ~1.4e-6.
"""

from __future__ import annotations

import pytest
import torch

from dhp.errors import DataError
from dhp.models import get_family
from dhp.models.qwen2_5_vl import mrope_positions
from dhp.models.testing import (
    modules_from_reference,
    reference_step,
    relative_error,
    split_step,
    tiny_vl_batch,
)

pytestmark = pytest.mark.parity
RTOL = 5e-6  # relative, fp32; see the module docstring


@pytest.fixture(scope="module")
def setup():
    family = get_family("qwen2_5_vl")
    hf_config = family.hf_config(family.tiny_model_config())
    torch.manual_seed(0)
    ref = family.reference_model(hf_config)
    modules = modules_from_reference(family, ref, hf_config)
    return family, hf_config, ref, modules


CASES = {
    # name: (images per sample as (grid_h, grid_w) in patches, text tokens before the images)
    "one_image": ([[(8, 6)]], [5]),
    "two_unequal_images": ([[(12, 8), (4, 6)]], [4]),
    "batch_of_2": ([[(8, 6)], [(4, 4), (6, 4)]], [3, 9]),
    "batch_image_and_text_only": ([[(8, 8)], []], [4, 30]),
    "text_only": ([[], []], [17, 11]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_split_matches_reference(setup, case):
    family, hf_config, ref, modules = setup
    images, text_lens = CASES[case]
    batch = tiny_vl_batch(hf_config, images=images, text_lens=text_lens, seed=len(case))
    ref_loss, ref_grads = reference_step(ref, batch)
    loss, grads = split_step(family, modules["vision"], modules["llm"], batch)

    assert relative_error(loss, ref_loss) <= RTOL, (loss.item(), ref_loss.item())
    mapped = {}
    for ref_name in ref_grads:
        module_name, fqn = family.checkpoint_owner(ref_name)
        mapped[(module_name, fqn)] = ref_name
    got = {(m, n) for m, g in grads.items() for n in g}
    assert got == set(mapped), f"params with grads differ: {sorted(got ^ set(mapped))}"
    every = {(m, n) for m, mod in modules.items() for n, _ in mod.named_parameters()}
    has_images = batch["pixel_values"] is not None
    expected = every if has_images else {k for k in every if k[0] == "llm"}
    assert got == expected  # every parameter of the modules that ran got a gradient
    worst = max(relative_error(grads[m][n], ref_grads[mapped[(m, n)]]) for m, n in got)
    assert worst <= RTOL, f"{case}: worst relative grad error {worst}"


def test_text_only_batch_runs_no_encoder(setup):
    family, hf_config, ref, modules = setup
    batch = tiny_vl_batch(hf_config, images=[[]], text_lens=[12])
    assert batch["pixel_values"] is None and batch["image_grid_thw"] is None
    loss, grads = split_step(family, None, modules["llm"], batch)  # no vision module at all
    ref_loss, _ = reference_step(ref, batch)
    assert relative_error(loss, ref_loss) <= RTOL
    assert set(grads) == {"llm"}


def test_dropping_mm_token_type_ids_changes_positions(setup):
    """A known trap: without mm_token_type_ids transformers silently uses 1D positions."""
    _family, hf_config, ref, modules = setup
    batch = tiny_vl_batch(hf_config, images=[[(8, 6)]], text_lens=[5])
    mrope = mrope_positions(
        config=hf_config,
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        mm_token_type_ids=batch["mm_token_type_ids"],
        image_grid_thw=batch["image_grid_thw"],
    )
    seq = batch["input_ids"].shape[1]
    one_d = torch.arange(seq).view(1, 1, -1).expand(3, 1, -1)
    image_pos = batch["input_ids"][0] == hf_config.image_token_id
    assert not torch.equal(mrope[:, 0, image_pos], one_d[:, 0, image_pos])
    assert torch.equal(mrope[:, 0, ~image_pos][:, :5], one_d[:, 0, :5])  # text before the image: 1D

    with torch.no_grad():
        kwargs = {k: v for k, v in batch.items() if k != "sample_ids"}
        with_types = ref(**kwargs).loss
        kwargs.pop("mm_token_type_ids")
        without_types = ref(**kwargs).loss  # transformers: no error, different loss
    assert not torch.equal(with_types, without_types)

    leaf = modules["vision"](batch["pixel_values"], batch["image_grid_thw"])["image_embeds"].detach()
    with pytest.raises(DataError, match="mm_token_type_ids is missing"):
        modules["llm"](
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=batch["labels"],
            mm_token_type_ids=None,
            image_grid_thw=batch["image_grid_thw"],
            image_embeds=leaf,
            sample_ids=batch["sample_ids"],
        )


def test_split_matches_reference_with_tied_embeddings():
    """lm_head tied to embed_tokens: the shared weight's gradient sums both uses, as in transformers."""
    family = get_family("qwen2_5_vl")
    model_cfg = family.tiny_model_config()
    model_cfg.llm.tie_word_embeddings = True
    hf_config = family.hf_config(model_cfg)
    torch.manual_seed(1)
    ref = family.reference_model(hf_config)
    assert ref.lm_head.weight is ref.model.language_model.embed_tokens.weight
    modules = modules_from_reference(family, ref, hf_config)
    assert modules["llm"].lm_head.weight is modules["llm"].language_model.embed_tokens.weight
    batch = tiny_vl_batch(hf_config, images=[[(8, 6)], [(4, 4)]], text_lens=[3, 7], seed=3)
    ref_loss, ref_grads = reference_step(ref, batch)
    loss, grads = split_step(family, modules["vision"], modules["llm"], batch)
    assert relative_error(loss, ref_loss) <= RTOL
    for ref_name, ref_grad in ref_grads.items():
        module_name, fqn = family.checkpoint_owner(ref_name)
        assert relative_error(grads[module_name][fqn], ref_grad) <= RTOL, ref_name
