"""The Qwen3-VL-MoE module cut (vision -> image_embeds + DeepStack features -> MoE llm) against transformers.

One process, fp32 on CPU. The split side builds both modules from the family on meta, loads the
reference's split state dict, runs vision -> (detached leaves, one per edge) -> llm -> backward, then
feeds every edge's gradient back into the encoder's backward, as the runtime does. The reference is the
untouched ``Qwen3VLMoeForConditionalGeneration`` called with ``output_router_logits=True``, so its
``loss`` is the mean LM loss + ``router_aux_loss_coef`` x ``load_balancing_loss_func`` (padding masked
by ``attention_mask``), its ``aux_loss`` the unweighted load-balancing loss.

The tiny router is made to route unevenly (its weights scaled up, one expert favoured), with top-2 of
8 experts and one dense layer beside two sparse ones; the test asserts the imbalance it relies on.

Tolerances (the done-when bar): loss within 1e-5 relative, the aux loss within 1e-5 relative, every
parameter gradient within 1e-4 relative (max|split - ref| / max|ref|), every parameter compared, the
routers and the 3-D experts included. The cut is the same ops in the same order; the numeric
differences are dhp's chunked cross-entropy vs HF's log-softmax and the aux loss's float32 softmax
taken once more (a few 1e-7 in fp32).
"""

from __future__ import annotations

import pytest
import torch

from dhp.models import get_family
from dhp.models.qwen3_base.llm import ROUTER_AUX_LOSS
from dhp.models.qwen3_vision.arch import deepstack_kwarg
from dhp.models.testing import modules_from_reference, relative_error, skew_routers_, tiny_vl_batch

pytestmark = pytest.mark.parity
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


def _reference_step(ref, batch):
    """HF loss (LM + weighted aux), HF aux_loss, router logits and every grad of the untouched model."""
    ref.zero_grad(set_to_none=True)
    kwargs = {k: v for k, v in batch.items() if k != "sample_ids" and v is not None}
    out = ref(**kwargs, output_router_logits=True)
    out.loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.aux_loss.detach(), out.router_logits, grads


def _split_step(vision, llm, batch):
    """loss_sum/num_tokens, the LLM output and {module: {fqn: grad}}, as the runtime runs the cut."""
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
    return loss.detach(), out, grads


@pytest.fixture(scope="module")
def setup():
    family = get_family("qwen3_vl_moe")
    hf_config = family.tiny_hf_config()
    torch.manual_seed(0)
    ref = family.reference_model(hf_config)
    skew_routers_(dict(ref.named_parameters()), hf_config.text_config.hidden_size)
    return family, hf_config, ref, modules_from_reference(family, ref, hf_config)


CASES = {
    # name: (images per sample as (grid_h, grid_w) in patches, text tokens before the images)
    "two_samples_three_unequal_images": ([[(8, 6), (4, 10)], [(6, 6)]], [5, 9]),
    "image_and_padded_text_only_sample": ([[(10, 8)], []], [3, 25]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_qwen3_vl_moe_split_matches_reference(setup, case):
    family, hf_config, ref, modules = setup
    t = hf_config.text_config
    images, text_lens = CASES[case]
    batch = tiny_vl_batch(hf_config, images=images, text_lens=text_lens, seed=len(case))
    assert (batch["attention_mask"] == 0).any()  # padding: the aux loss must mask it as HF does
    ref_loss, ref_aux, router_logits, ref_grads = _reference_step(ref, batch)
    loss, out, grads = _split_step(modules["vision"], modules["llm"], batch)

    # the routing the test relies on: top-2 of 8, every sparse layer unbalanced
    sparse = [i for i in range(t.num_hidden_layers) if i not in t.mlp_only_layers]
    assert t.num_experts_per_tok == 2 and len(router_logits) == len(sparse) == 2 and t.mlp_only_layers
    for logits in router_logits:
        counts = torch.bincount(logits.topk(2, dim=-1).indices.reshape(-1), minlength=t.num_experts)
        assert counts.max() >= 1.8 * counts.float().mean(), counts.tolist()

    assert relative_error(loss, ref_loss) <= LOSS_RTOL, (loss.item(), ref_loss.item())
    aux = out.aux_losses[ROUTER_AUX_LOSS]
    assert relative_error(aux, ref_aux) <= LOSS_RTOL, (aux.item(), ref_aux.item())
    # the aux term is a visible part of the loss (well above the tolerance), not a rounding error
    assert t.router_aux_loss_coef * ref_aux > 100 * LOSS_RTOL * ref_loss

    every = {(m, n) for m, mod in modules.items() for n, _ in mod.named_parameters()}
    got = {(m, n) for m, g in grads.items() for n in g}
    assert got == every  # every parameter of both modules got a gradient
    mapped = {family.checkpoint_owner(name): name for name in ref_grads}
    assert set(mapped) == every
    errors = {(m, n): relative_error(grads[m][n], ref_grads[mapped[(m, n)]]) for m, n in every}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"{case}: worst relative grad error {errors[worst]} at {worst}"
    names = {n for _, n in every}
    for i in sparse:  # routers and 3-D experts are among those compared
        assert {
            f"language_model.layers.{i}.mlp.{p}" for p in ("gate.weight", "experts.gate_up_proj")
        } <= names
    assert "language_model.layers.2.mlp.gate_proj.weight" in names  # the dense layer


def test_qwen3_vl_moe_aux_loss_reaches_the_router_gradient(setup):
    """Without the aux term the routers' gradients differ from the reference's by far more than the
    tolerance: the parity above observes the load-balancing loss, not only the LM loss."""
    family, hf_config, ref, modules = setup
    batch = tiny_vl_batch(hf_config, images=[[(8, 6)]], text_lens=[5], seed=3)
    _, _, _, ref_grads = _reference_step(ref, batch)
    llm = modules["llm"]
    coef = llm.vl_config.text_config.router_aux_loss_coef
    try:
        llm.vl_config.text_config.router_aux_loss_coef = 0.0
        _, out, grads = _split_step(modules["vision"], llm, batch)
    finally:
        llm.vl_config.text_config.router_aux_loss_coef = coef
    router = "language_model.layers.0.mlp.gate.weight"
    gap = relative_error(grads["llm"][router], ref_grads[family.hf_key("llm", router)])
    assert gap > 100 * GRAD_RTOL, gap
    # unbalanced routing: above top_k, the value of a perfectly balanced router
    assert out.aux_losses[ROUTER_AUX_LOSS] > 1.1 * hf_config.text_config.num_experts_per_tok


def test_qwen3_vl_moe_deepstack_edges_change_the_loss(setup):
    """Each DeepStack edge reaches the MoE LLM: zeroing one level's rows changes the loss."""
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
