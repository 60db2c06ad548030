"""EP at ep=4 (4 gloo ranks, dp=4 x ep=4) with experts and a whole EP rank that receive no tokens.

The tiny Qwen3-VL-MoE LLM has 8 experts (2 per EP rank here). Its routers are skewed
(``skew_routers_``) and the router rows of experts 2, 3 and 5 are then set to ``-40 u`` (``u`` the
direction ``skew_routers_`` adds to every token embedding), so on this text-only batch (rows of equal
length: no padding tokens, whose hidden states, and so routes, the loss does not pin) no token picks
them: EP rank 1 (experts 2 and 3) receives zero rows in every sparse layer, and rank 2 runs one expert
with rows next to one with none. Both are counted, not assumed: from the reference's router logits
(per expert) and from each EP module's own all-to-all rows (per rank), which must agree.

Each rank builds the reference itself (same seed, same edits) and feeds one sample; the step's loss is
``sum_r loss_sum_r / T`` (T the global label count) against transformers'
``Qwen3VLMoeForConditionalGeneration`` loss (load-balancing loss included), and every LLM gradient
(finalized: DP sums, expert shards gathered) against transformers' on the whole batch.

Tolerances (fp32, CPU; only summation order differs): loss and aux loss <= 1e-5 relative, every
gradient <= 1e-4 relative (max|d| / max|ref|).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_harness import spawn

from dhp.layout import ParallelLayout
from dhp.models import get_family
from dhp.models.qwen3_base.llm import ROUTER_AUX_LOSS
from dhp.models.testing import (
    ROUTER_SUFFIX,
    modules_from_reference,
    relative_error,
    skew_routers_,
    tiny_vl_batch,
)
from dhp.parallel import build_mesh, finalize_grads, full_grad_dict, parallelize
from dhp.parallel.ep import ExpertParallelExperts

pytestmark = [pytest.mark.parity, pytest.mark.slow]
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
EP, COLD = 4, (2, 3, 5)  # experts no token may pick: rank 1's both, and one of rank 2's
FIELDS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids")


def _cold_routers_(ref, hidden: int) -> None:
    """``skew_routers_``, then the ``COLD`` experts' router rows = -40 u (u: its embedding direction)."""
    params = dict(ref.named_parameters())
    skew_routers_(params, hidden, seed=7)
    gen = torch.Generator().manual_seed(7)  # the same u as skew_routers_(seed=7)
    u = torch.randn(hidden, generator=gen)
    u /= u.norm()
    with torch.no_grad():
        for key, t in params.items():
            if key.endswith(ROUTER_SUFFIX):
                t[list(COLD)] = -40.0 * u


def _expert_counts(router_logits, top_k: int, experts: int) -> torch.Tensor:
    """[layers, experts]: how many (token, slot) assignments each expert gets on the whole batch."""
    return torch.stack(
        [torch.bincount(lg.topk(top_k, -1).indices.reshape(-1), minlength=experts) for lg in router_logits]
    )


def _received_rows(llm, tokens: int, top_k: int) -> torch.Tensor:
    """Rows each sparse layer's EP module received in its last forward (its a2a rows minus those sent)."""
    mods = [m for m in llm.modules() if isinstance(m, ExpertParallelExperts)]
    return torch.tensor([m.last_a2a_rows - tokens * top_k for m in mods])


def _case(rank: int, world: int) -> None:
    family = get_family("qwen3_vl_moe")
    cfg = family.tiny_hf_config()
    text = cfg.text_config
    assert text.num_experts == 8
    torch.manual_seed(0)
    ref = family.reference_model(cfg)
    _cold_routers_(ref, text.hidden_size)
    batch = tiny_vl_batch(cfg, images=[[], [], [], []], text_lens=[10, 10, 10, 10], seed=4)
    ref.zero_grad(set_to_none=True)
    ref_out = ref(**{k: batch[k] for k in FIELDS}, output_router_logits=True)
    ref_out.loss.backward()
    want = family.split_state_dict({n: p.grad for n, p in ref.named_parameters()})["llm"]

    counts = _expert_counts(ref_out.router_logits, text.num_experts_per_tok, text.num_experts)
    assert counts[:, list(COLD)].sum() == 0, counts  # those experts get no token in any layer
    assert (counts.view(len(counts), EP, -1).sum(-1)[:, 1] == 0).all(), counts  # nor EP rank 1
    assert (counts[:, 4] > 0).all(), counts  # rank 2 runs expert 4's rows next to expert 5's none

    layout = ParallelLayout(dp=world, ep=EP)
    mesh = build_mesh(layout, "cpu")
    llm = modules_from_reference(family, ref, cfg)["llm"]
    parallelize("llm", llm, mesh, layout=layout, activation_checkpointing="off", mixed_precision="fp32")
    llm.aux_loss_group = mesh.get_group("dp")
    total = int((batch["labels"][:, 1:] != -100).sum())
    mine = {k: batch[k][rank : rank + 1] for k in FIELDS}
    out = llm(**mine, image_grid_thw=None, sample_ids=[batch["sample_ids"][rank]])
    (out.loss_sum / total).backward()

    received = _received_rows(llm, mine["input_ids"].numel(), text.num_experts_per_tok)
    every = [torch.empty_like(received) for _ in range(world)]
    dist.all_gather(every, received)
    per_rank = counts.view(len(counts), EP, -1).sum(-1).T  # [ep rank, layer]
    assert torch.equal(torch.stack(every), per_rank), (every, per_rank)

    finalize_grads(llm, mesh, layout=layout)
    loss = (out.loss_sum / total).detach()
    dist.all_reduce(loss)
    assert relative_error(loss, ref_out.loss) <= LOSS_RTOL, (loss.item(), ref_out.loss.item())
    assert relative_error(out.aux_losses[ROUTER_AUX_LOSS], ref_out.aux_loss) <= LOSS_RTOL
    grads = full_grad_dict(llm)
    assert set(grads) == set(want), set(grads) ^ set(want)
    errors = {n: relative_error(grads[n], want[n]) for n in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"worst relative grad error {errors[worst]:.2e} at {worst}"
    for name in [n for n in want if n.endswith("experts.gate_up_proj")]:  # the cold experts' rows: zero
        assert not grads[name][list(COLD)].any(), name


def test_ep4_with_empty_experts_and_an_idle_rank_matches_hf():
    spawn(_case, 4)
