"""Qwen3.5's MoE flavour (``tiny_qwen3_5_moe``): its LLM module, parallelized by the family's plan on gloo,
against transformers' ``Qwen3_5MoeForConditionalGeneration`` on the whole batch.

Each rank builds the reference itself (same seed; ``A_log`` redrawn from log U(0.01, 1) as in
``tests/parity/test_split_qwen3_5.py``; routers skewed by ``skew_routers_`` so the load-balancing loss
is far above rounding), runs the encoder locally (its output enters the LLM as a leaf, as the runtime's
hand-off does) and compares:

(a) tp=2 (2 ranks): gated attention, Gated DeltaNet heads, the shared expert and the embeddings / lm_head
    cut over tp; routers and routed experts whole on both ranks, which see the whole batch; the loss is
    ``loss_sum / num_tokens``;
(b) dp=2 x tp=2 x ep=2 (4 ranks, slow): each data rank feeds one sample and, within its tp index, the EP
    group folds the two data ranks (4 of the 8 experts each); ``aux_loss_group`` = the data ranks; the
    step's loss is ``sum_dp loss_sum / T`` (T the global label count).
Both: HF's loss (load-balancing loss included) and aux loss, and every LLM gradient after
``finalize_grads`` (DP sums, expert shards and TP shards gathered whole).

Tolerances (fp32, CPU; only summation order differs): loss and aux loss <= 1e-5 relative, every
gradient <= 1e-4 relative (max|d| / max|ref|).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_harness import spawn
from torch.distributed.tensor import DTensor

from dhp.layout import ParallelLayout
from dhp.models import get_family
from dhp.models.qwen3_base.llm import ROUTER_AUX_LOSS
from dhp.models.testing import modules_from_reference, relative_error, skew_routers_, tiny_vl_batch
from dhp.parallel import build_mesh, finalize_grads, full_grad_dict, parallelize
from dhp.parallel.ep import expert_params

pytestmark = pytest.mark.parity
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
FIELDS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids")
IMAGES, IMAGES_OF = [[(8, 6), (4, 10)], [(6, 6)]], {0: [0, 1], 1: [2]}


def _reference():
    family = get_family("qwen3_5")
    cfg = family.tiny_hf_config(moe=True)
    torch.manual_seed(0)
    ref = family.reference_model(cfg)
    assert type(ref).__name__ == "Qwen3_5MoeForConditionalGeneration"
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if name.endswith("linear_attn.A_log"):
                param.copy_(torch.rand(param.shape, generator=gen).mul_(0.99).add_(0.01).log_())
    skew_routers_(dict(ref.named_parameters()), cfg.text_config.hidden_size)
    batch = tiny_vl_batch(cfg, images=IMAGES, text_lens=[5, 9], seed=3)
    ref.zero_grad(set_to_none=True)
    out = ref(**{k: v for k, v in batch.items() if k != "sample_ids"}, output_router_logits=True)
    out.loss.backward()
    want = family.split_state_dict({n: p.grad for n, p in ref.named_parameters()})["llm"]
    return family, cfg, ref, batch, out, want


def _sample(cfg, batch, b: int) -> dict:
    """Sample ``b`` alone: its row, its images' patch rows and grids."""
    per_image = [int(g.prod()) for g in batch["image_grid_thw"]]
    starts = [sum(per_image[:i]) for i in range(len(per_image) + 1)]
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in IMAGES_OF[b]])
    return {
        **{k: batch[k][b : b + 1] for k in FIELDS},
        "pixel_values": batch["pixel_values"][rows],
        "image_grid_thw": batch["image_grid_thw"][IMAGES_OF[b]],
        "sample_ids": [batch["sample_ids"][b]],
    }


def _llm_step(vision, llm, part: dict, total: int):
    """The encoder locally (no grad: its output is a leaf), then the LLM's forward and ``loss_sum / T``."""
    with torch.no_grad():
        edges = vision(part["pixel_values"], part["image_grid_thw"])
    out = llm(**{k: part[k] for k in (*FIELDS, "image_grid_thw", "sample_ids")}, **edges)
    (out.loss_sum / total).backward()
    return out


def _check(llm, mesh, layout, out, loss, ref_out, want, tag: str) -> None:
    finalize_grads(llm, mesh, layout=layout)
    assert relative_error(loss, ref_out.loss) <= LOSS_RTOL, (tag, loss.item(), ref_out.loss.item())
    aux = out.aux_losses[ROUTER_AUX_LOSS]
    assert relative_error(aux, ref_out.aux_loss) <= LOSS_RTOL, (tag, aux.item(), ref_out.aux_loss.item())
    grads = full_grad_dict(llm)
    assert set(grads) == set(want), set(grads) ^ set(want)
    errors = {n: relative_error(grads[n], want[n]) for n in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"{tag}: worst relative grad error {errors[worst]:.2e} at {worst}"


def _tp(rank: int, world: int) -> None:
    family, cfg, ref, batch, ref_out, want = _reference()
    layout = ParallelLayout(tp=world)
    mesh = build_mesh(layout, "cpu")
    modules = modules_from_reference(family, ref, cfg)
    llm = parallelize("llm", modules["llm"], mesh, layout=layout, activation_checkpointing="off",
                      mixed_precision="fp32")  # fmt: skip
    assert not isinstance(llm.language_model.layers[0].mlp.experts.gate_up_proj, DTensor)  # whole per rank
    assert isinstance(llm.language_model.layers[0].mlp.shared_expert.gate_proj.weight, DTensor)  # cut
    total = int((batch["labels"][:, 1:] != -100).sum())
    out = _llm_step(modules["vision"], llm, batch, total)
    assert out.num_tokens == total
    _check(llm, mesh, layout, out, (out.loss_sum / total).detach(), ref_out, want, "tp=2")


def _tp_ep(rank: int, world: int) -> None:
    family, cfg, ref, batch, ref_out, want = _reference()
    layout = ParallelLayout(dp=2, tp=2, ep=2)
    mesh = build_mesh(layout, "cpu")
    modules = modules_from_reference(family, ref, cfg)
    llm = parallelize("llm", modules["llm"], mesh, layout=layout, activation_checkpointing="off",
                      mixed_precision="fp32")  # fmt: skip
    experts = expert_params(llm)
    n_sparse = cfg.text_config.num_hidden_layers
    assert len(experts) == 2 * n_sparse and all(p.to_local().shape[0] == 4 for _, p in experts)
    llm.aux_loss_group = mesh.get_group("dp")
    total = int((batch["labels"][:, 1:] != -100).sum())
    out = _llm_step(modules["vision"], llm, _sample(cfg, batch, layout.coords(rank)["dp"]), total)
    loss = (out.loss_sum / total).detach()
    dist.all_reduce(loss, group=mesh.get_group("dp"))
    _check(llm, mesh, layout, out, loss, ref_out, want, "dp=2 x tp=2 x ep=2")


def test_qwen3_5_moe_llm_tp2_matches_hf() -> None:
    spawn(_tp, 2)


@pytest.mark.slow
def test_qwen3_5_moe_llm_dp2_tp2_ep2_matches_hf() -> None:
    spawn(_tp_ep, 4)
