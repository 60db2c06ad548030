"""The Qwen3.5 module cut (vision -> image_embeds -> hybrid llm) against transformers.

One process, fp32 on CPU. The split side builds both modules from the family on meta, loads the
reference's split state dict, runs vision -> (a detached leaf) -> llm -> backward, then feeds the
edge's gradient back into the encoder's backward, as the runtime does. The LLM's Gated DeltaNet layers
run transformers' torch fallback of the chunked gated delta rule and of the causal conv1d.

Tolerances (the done-when bar): loss within 1e-5 relative, every parameter gradient within 1e-4
relative (max|split - ref| / max|ref|), every parameter compared: the DeltaNet projections, conv1d,
dt_bias, A_log and gated norm, the gated attention's q/k norms, the learned position table. The cut is
the same ops in the same order; the only numeric difference is dhp's chunked cross-entropy vs HF's
log-softmax, a few 1e-7 in fp32.

The reference's ``A_log`` is redrawn from log U(0.01, 1) instead of transformers' log U(0.01, 16): with
decay rates up to 16 most tiny heads forget their state within a token, their dt_bias / A_log gradients
are ~1e-6 of the others' and a relative comparison of them measures fp32 rounding, not the cut. Slower
decay makes the recurrence carry information along the sequence, which is what this test must see.

The MoE flavour (``tiny_qwen3_5_moe``) is compared against the untouched
``Qwen3_5MoeForConditionalGeneration`` called with ``output_router_logits=True``: its ``loss`` is the
mean LM loss + ``router_aux_loss_coef`` x ``load_balancing_loss_func`` (padding masked by
``attention_mask``), its ``aux_loss`` the unweighted value; same tolerances, every gradient compared
(routers, 3-D experts, shared experts and their gates included). Its routers are skewed (scaled up,
two experts favoured) so routing is decisive and unbalanced and the aux term is far above tolerance.
"""

from __future__ import annotations

import pytest
import torch

from dhp.errors import DataError
from dhp.models import get_family
from dhp.models.qwen3_base.llm import ROUTER_AUX_LOSS
from dhp.models.testing import (
    modules_from_reference,
    reference_step,
    relative_error,
    skew_routers_,
    split_step,
    tiny_vl_batch,
)

pytestmark = pytest.mark.parity
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


def slow_decay_(model: torch.nn.Module, *, seed: int = 0) -> None:
    """Redraw every Gated DeltaNet's ``A_log`` as log U(0.01, 1) (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.A_log"):
                param.copy_(torch.rand(param.shape, generator=gen).mul_(0.99).add_(0.01).log_())


@pytest.fixture(scope="module")
def setup():
    family = get_family("qwen3_5")
    hf_config = family.tiny_hf_config()
    torch.manual_seed(0)
    ref = family.reference_model(hf_config)
    slow_decay_(ref)
    return family, hf_config, ref, modules_from_reference(family, ref, hf_config)


CASES = {
    # name: (images per sample as (grid_h, grid_w) in patches, text tokens before the images)
    "two_samples_three_unequal_images": ([[(8, 6), (4, 10)], [(6, 6)]], [5, 9]),
    "image_and_text_only_sample": ([[(10, 8)], []], [3, 25]),
    # 89 tokens: two chunks of transformers' chunked delta rule (64), the state carried across them
    "longer_than_one_delta_rule_chunk": ([[(4, 4)], [(2, 2)]], [80, 5]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_qwen3_5_split_matches_reference(setup, case):
    family, hf_config, ref, modules = setup
    images, text_lens = CASES[case]
    batch = tiny_vl_batch(hf_config, images=images, text_lens=text_lens, seed=len(case))
    ref_loss, ref_grads = reference_step(ref, batch)
    loss, grads = split_step(family, modules["vision"], modules["llm"], batch)
    assert relative_error(loss, ref_loss) <= LOSS_RTOL, (loss.item(), ref_loss.item())

    every = {(m, n) for m, mod in modules.items() for n, _ in mod.named_parameters()}
    got = {(m, n) for m, g in grads.items() for n in g}
    assert got == every  # every parameter of both modules got a gradient
    mapped = {family.checkpoint_owner(name): name for name in ref_grads}
    assert set(mapped) == every
    errors = {(m, n): relative_error(grads[m][n], ref_grads[mapped[(m, n)]]) for m, n in every}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"{case}: worst relative grad error {errors[worst]} at {worst}"
    # the hybrid layers' own parameters are among those compared
    names = {n for _, n in every}
    kinds = hf_config.text_config.layer_types
    assert "linear_attention" in kinds and "full_attention" in kinds
    for part in ("in_proj_qkv.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight"):
        assert f"language_model.layers.0.linear_attn.{part}" in names, part
    last_full = len(kinds) - 1 - kinds[::-1].index("full_attention")
    assert f"language_model.layers.{last_full}.self_attn.q_norm.weight" in names
    assert "visual.pos_embed.weight" in names and not any("deepstack" in n for n in names)


def test_qwen3_5_vision_has_one_edge_and_the_llm_checks_it(setup):
    """K = 0: the encoder returns image_embeds alone; the LLM refuses image embeddings that do not
    match the image tokens."""
    _family, hf_config, _ref, modules = setup
    batch = tiny_vl_batch(hf_config, images=[[(8, 6)]], text_lens=[5], seed=1)
    with torch.no_grad():
        outs = modules["vision"](batch["pixel_values"], batch["image_grid_thw"])
    assert set(outs) == {"image_embeds"}
    kwargs = {
        k: batch[k] for k in ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "image_grid_thw")
    }
    with pytest.raises(DataError):
        modules["llm"](**kwargs, image_embeds=outs["image_embeds"][:-1])


def test_qwen3_5_moe_split_matches_reference():
    """The MoE flavour: loss incl. the aux loss, the aux loss itself and every grad vs transformers."""
    family = get_family("qwen3_5")
    hf_config = family.tiny_hf_config(moe=True)
    t = hf_config.text_config
    torch.manual_seed(0)
    ref = family.reference_model(hf_config)
    assert type(ref).__name__ == "Qwen3_5MoeForConditionalGeneration"
    slow_decay_(ref)
    assert skew_routers_(dict(ref.named_parameters()), t.hidden_size) == t.num_hidden_layers
    modules = modules_from_reference(family, ref, hf_config)
    batch = tiny_vl_batch(hf_config, images=[[(8, 6), (4, 10)], [(6, 6)]], text_lens=[5, 9], seed=3)
    assert (batch["attention_mask"] == 0).any()  # padding: the aux loss must mask it as HF does

    ref.zero_grad(set_to_none=True)
    kwargs = {k: v for k, v in batch.items() if k != "sample_ids" and v is not None}
    ref_out = ref(**kwargs, output_router_logits=True)
    ref_out.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    for logits in ref_out.router_logits:  # the routing the test relies on: unbalanced in every layer
        counts = torch.bincount(logits.topk(t.num_experts_per_tok, dim=-1).indices.reshape(-1), minlength=8)
        assert counts.max() >= 1.8 * counts.float().mean(), counts.tolist()

    llm_outputs = []
    llm = modules["llm"]
    handle = llm.register_forward_hook(lambda _m, _a, out: llm_outputs.append(out))
    try:
        loss, grads = split_step(family, modules["vision"], llm, batch)
    finally:
        handle.remove()
    assert relative_error(loss, ref_out.loss) <= LOSS_RTOL, (loss.item(), ref_out.loss.item())
    aux = llm_outputs[0].aux_losses[ROUTER_AUX_LOSS]
    assert relative_error(aux, ref_out.aux_loss) <= LOSS_RTOL, (aux.item(), ref_out.aux_loss.item())
    # the aux term is a visible part of the loss (well above the tolerance), not a rounding error
    assert t.router_aux_loss_coef * ref_out.aux_loss > 100 * LOSS_RTOL * ref_out.loss

    every = {(m, n) for m, mod in modules.items() for n, _ in mod.named_parameters()}
    assert {(m, n) for m, g in grads.items() for n in g} == every  # every parameter got a gradient
    mapped = {family.checkpoint_owner(name): name for name in ref_grads}
    assert set(mapped) == every
    errors = {(m, n): relative_error(grads[m][n], ref_grads[mapped[(m, n)]]) for m, n in every}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"worst relative grad error {errors[worst]} at {worst}"
    names = {n for _, n in every}
    for i in range(t.num_hidden_layers):  # router, 3-D experts, shared expert and its gate, every layer
        for part in (
            "gate.weight",
            "experts.gate_up_proj",
            "experts.down_proj",
            "shared_expert.down_proj.weight",
            "shared_expert_gate.weight",
        ):
            assert f"language_model.layers.{i}.mlp.{part}" in names, (i, part)
