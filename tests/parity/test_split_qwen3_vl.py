"""The Qwen3-VL module cut (vision -> image_embeds + DeepStack features -> llm) against transformers.

One process, fp32 on CPU. The split side builds both modules from the family on meta, loads the
reference's split state dict, runs vision -> (detached leaves, one per edge) -> llm -> backward, then
feeds every edge's gradient back into the encoder's backward, as the runtime does.

Tolerances (the done-when bar): loss within 1e-5 relative, every parameter gradient within 1e-4
relative (max|split - ref| / max|ref|), every parameter compared, the DeepStack mergers and the learned
position table included. The cut is the same ops in the same order; the only numeric difference is dhp's
chunked cross-entropy (softmax gradient as exp(logit - lse)) vs HF's log-softmax, a few 1e-7 in fp32.
"""

from __future__ import annotations

import pytest
import torch

from dhp.errors import DataError
from dhp.models import get_family
from dhp.models.qwen3_vl import deepstack_kwarg  # registers the family
from dhp.models.testing import reference_step, relative_error, tiny_vl_batch

pytestmark = pytest.mark.parity
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


def _modules(family, ref, hf_config):
    """Both modules built on meta, materialised, and loaded strictly from the reference's split state dict."""
    parts = family.split_state_dict(ref.state_dict())
    modules = {}
    for name in family.module_names:
        module = family.build_module(name, hf_config, device="meta", dtype=torch.float32)
        module.to_empty(device="cpu")
        tied = family.tied_parameters(name, hf_config)
        module.load_state_dict({k: v for k, v in parts[name].items() if k not in tied}, strict=not tied)
        family.tie(name, module, hf_config)
        family.init_buffers(name, module)
        modules[name] = module
    return modules


def _split_step(vision, llm, batch):
    """loss_sum/num_tokens and {module: {fqn: grad}}: every edge crosses as a detached leaf, grads go back."""
    for m in (vision, llm):
        m.zero_grad(set_to_none=True)
    outs, leaves = {}, {}
    if batch["pixel_values"] is not None:
        outs = vision(batch["pixel_values"], batch["image_grid_thw"])
        leaves = {k: v.detach().requires_grad_(True) for k, v in outs.items()}
    out = llm(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        labels=batch["labels"],
        mm_token_type_ids=batch["mm_token_type_ids"],
        image_grid_thw=batch["image_grid_thw"],
        sample_ids=batch["sample_ids"],
        **leaves,
    )
    loss = out.loss_sum / out.num_tokens
    loss.backward()
    if outs:
        names = list(outs)
        torch.autograd.backward([outs[k] for k in names], [leaves[k].grad for k in names])
    grads = {
        name: {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        for name, m in (("vision", vision), ("llm", llm))
    }
    return loss.detach(), grads, leaves


@pytest.fixture(scope="module")
def setup():
    family = get_family("qwen3_vl")
    hf_config = family.tiny_hf_config()
    torch.manual_seed(0)
    ref = family.reference_model(hf_config)
    return family, hf_config, ref, _modules(family, ref, hf_config)


CASES = {
    # name: (images per sample as (grid_h, grid_w) in patches, text tokens before the images)
    "two_samples_three_unequal_images": ([[(8, 6), (4, 10)], [(6, 6)]], [5, 9]),
    "image_and_text_only_sample": ([[(10, 8)], []], [3, 25]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_qwen3_vl_split_matches_reference(setup, case):
    family, hf_config, ref, modules = setup
    images, text_lens = CASES[case]
    batch = tiny_vl_batch(hf_config, images=images, text_lens=text_lens, seed=len(case))
    ref_loss, ref_grads = reference_step(ref, batch)
    loss, grads, leaves = _split_step(modules["vision"], modules["llm"], batch)

    levels = len(hf_config.vision_config.deepstack_visual_indexes)
    assert levels >= 2 and set(leaves) == {"image_embeds", *(deepstack_kwarg(k) for k in range(levels))}
    assert all(leaf.grad is not None and leaf.grad.abs().sum() > 0 for leaf in leaves.values())
    assert relative_error(loss, ref_loss) <= LOSS_RTOL, (loss.item(), ref_loss.item())

    every = {(m, n) for m, mod in modules.items() for n, _ in mod.named_parameters()}
    got = {(m, n) for m, g in grads.items() for n in g}
    assert got == every  # every parameter of both modules got a gradient
    mapped = {family.checkpoint_owner(name): name for name in ref_grads}
    assert set(mapped) == every
    errors = {(m, n): relative_error(grads[m][n], ref_grads[mapped[(m, n)]]) for m, n in every}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"{case}: worst relative grad error {errors[worst]} at {worst}"
    # the Qwen3-VL-specific parameters are among those compared
    names = {n for _, n in every}
    assert "visual.pos_embed.weight" in names
    assert any(n.startswith(f"visual.deepstack_merger_list.{levels - 1}.") for n in names)


def test_qwen3_vl_deepstack_edges_change_the_loss(setup):
    """Each DeepStack edge reaches the LLM: zeroing one level's rows changes the loss."""
    _family, hf_config, _ref, modules = setup
    batch = tiny_vl_batch(hf_config, images=[[(8, 6)]], text_lens=[5], seed=1)
    with torch.no_grad():
        outs = modules["vision"](batch["pixel_values"], batch["image_grid_thw"])
        kwargs = {
            k: batch[k]
            for k in ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "image_grid_thw")
        }
        full = modules["llm"](**kwargs, **outs).loss_sum
        for level in range(len(hf_config.vision_config.deepstack_visual_indexes)):
            name = deepstack_kwarg(level)
            dropped = modules["llm"](**kwargs, **{**outs, name: torch.zeros_like(outs[name])}).loss_sum
            assert not torch.equal(full, dropped), name
        missing = {k: v for k, v in outs.items() if k != deepstack_kwarg(1)}
        with pytest.raises(DataError, match="DeepStack features"):
            modules["llm"](**kwargs, **missing)


def test_qwen3_vl_text_only_micro_batch_with_every_edge_none(setup):
    """A micro-batch without images: the runtime's consumer passes every edge of the producer that
    sent nothing as None (image_embeds and each DeepStack level); the LLM then matches transformers
    fed no pixels: loss within 1e-5 relative, every LLM gradient within 1e-4."""
    family, hf_config, ref, modules = setup
    batch = tiny_vl_batch(hf_config, images=[[], []], text_lens=[7, 12], seed=3)
    assert batch["pixel_values"] is None
    ref_loss, ref_grads = reference_step(ref, batch)
    llm = modules["llm"]
    llm.zero_grad(set_to_none=True)
    edges = dict.fromkeys(h.kwarg for h in family.handoffs_for(hf_config))
    assert len(edges) == 1 + len(hf_config.vision_config.deepstack_visual_indexes)
    keys = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "image_grid_thw", "sample_ids")
    out = llm(**{k: batch[k] for k in keys}, **edges)
    loss = out.loss_sum / out.num_tokens
    loss.backward()
    assert relative_error(loss.detach(), ref_loss) <= LOSS_RTOL, (loss.item(), ref_loss.item())
    mapped = {family.checkpoint_owner(name): name for name in ref_grads}
    grads = {n: p.grad for n, p in llm.named_parameters() if p.grad is not None}
    assert grads and all(("llm", n) in mapped for n in grads)
    worst = max(relative_error(g, ref_grads[mapped[("llm", n)]]) for n, g in grads.items())
    assert worst <= GRAD_RTOL, worst
