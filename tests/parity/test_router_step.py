"""The router's load-balancing loss over the whole step, whatever the micro-batch cut or the data-parallel
degree, against transformers' own model on the step's batch in ONE call.

transformers' ``...ForConditionalGeneration`` with ``output_router_logits=True`` returns ``loss = mean CE +
router_aux_loss_coef * load_balancing_loss_func`` over the batch it is called with. The batch of a dhp
step is every micro-batch of every data replica, so the same step cut into micro-batches must give the
same loss and the same gradients. The split side runs the family's two modules as the runtime does: a
statistics pass first (per micro-batch the encoder without gradient, then the LLM with
``batch_statistics=True``: the routing sums over its token ranks), then per micro-batch the encoder, the
LLM with the step's sums (``step_statistics``) backpropagating ``loss_sum / T``, and the image rows'
gradient back into the encoder. Both MoE families, 4 samples (images of different sizes, a text-only
sample, padding), routers skewed so routing is decisive and uneven (``dhp.models.testing.skew_routers_``,
checked below):

- one rank, 4 micro-batches of 1 sample, and one rank, 2 micro-batches of 2 samples;
- the per-micro-batch definition (no statistics pass) on the same cut: far from transformers' (the
  comparison can fail for the right reason);
- 2 gloo ranks (dp = 2, ``aux_loss_group`` = both) x 2 micro-batches each, gradients summed over the ranks;
- slow: 4 gloo ranks x 1 micro-batch, where the forward's own all-reduce gives the step's counts.

The runtime's statistics pass itself (driver, workers, hand-offs) is held by ``dhp verify`` in
``tests/integration/test_verify_router.py``.

Tolerances (fp32 on CPU; the sums differ only in float order): loss within 1e-5 relative, every
parameter's gradient within 1e-4 relative (max|split - ref| / max|ref|), routers and 3-D experts included.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_harness import spawn
from test_split_qwen3_5 import slow_decay_

from dhp.models import get_family
from dhp.models.family import StepStatistics
from dhp.models.testing import modules_from_reference, relative_error, skew_routers_, tiny_vl_batch

pytestmark = pytest.mark.parity
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4

#: family -> the tiny MoE config's keyword
FAMILIES = {"qwen3_vl_moe": {}, "qwen3_5": {"moe": True}}
#: the family each test runs in the fast tier (one each, so both families stay there); the full suite runs both
FAST = {"one_rank": "qwen3_vl_moe", "two_ranks": "qwen3_5"}
#: the step's 4 samples: (images as (grid_h, grid_w) in patches, text tokens before them)
SAMPLES = [([(8, 6)], 5), ([(4, 10), (6, 6)], 9), ([], 25), ([(10, 8)], 3)]
KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids")


def build(name: str):
    """(family, hf_config, HF reference with skewed routers, the family's modules with its weights)."""
    family = get_family(name)
    hf_config = family.tiny_hf_config(**FAMILIES[name])
    torch.manual_seed(0)
    ref = family.reference_model(hf_config)
    if name == "qwen3_5":
        slow_decay_(ref)  # the DeltaNet gradients above rounding (tests/parity/test_split_qwen3_5.py)
    assert skew_routers_(dict(ref.named_parameters()), hf_config.text_config.hidden_size) >= 2
    return family, hf_config, ref, modules_from_reference(family, ref, hf_config)


def samples(hf_config) -> list[dict]:
    return [
        tiny_vl_batch(hf_config, images=[images], text_lens=[n], seed=10 + k)
        for k, (images, n) in enumerate(SAMPLES)
    ]


def concat(parts: list[dict], pad: int) -> dict:
    """The samples of ``parts`` as one right-padded batch (what a data replica or HF is given)."""
    seq = max(p["input_ids"].shape[1] for p in parts)
    fill = {"input_ids": pad, "attention_mask": 0, "labels": -100, "mm_token_type_ids": 0}
    out = {
        k: torch.cat([torch.nn.functional.pad(p[k], (0, seq - p[k].shape[1]), value=fill[k]) for p in parts])
        for k in KEYS
    }
    for k in ("pixel_values", "image_grid_thw"):
        kept = [p[k] for p in parts if p[k] is not None]
        out[k] = torch.cat(kept) if kept else None
    out["sample_ids"] = [i for p in parts for i in p["sample_ids"]]
    return out


def label_tokens(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def hf_step(ref, hf_config, whole: dict):
    """transformers' loss on the whole batch in one call, its grads by reference name, the routing."""
    ref.zero_grad(set_to_none=True)
    out = ref(**{k: v for k, v in whole.items() if k != "sample_ids"}, output_router_logits=True)
    out.loss.backward()
    k = hf_config.text_config.num_experts_per_tok
    for logits in out.router_logits:  # the routing the test relies on: unbalanced in every MoE layer
        counts = torch.bincount(logits.topk(k, dim=-1).indices.reshape(-1), minlength=logits.shape[-1])
        assert counts.max() >= 1.8 * counts.float().mean(), counts.tolist()
    return out.loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}


def _llm_kwargs(batch: dict, leaves: dict) -> dict:
    return {k: batch[k] for k in (*KEYS, "image_grid_thw", "sample_ids")} | leaves


def split_step(modules: dict, micro_batches: list[dict], *, num_label_tokens: int, step: bool):
    """Σ loss_sum / T over ``micro_batches`` and {module: {fqn: grad}} as the runtime runs them; ``step``:
    with the statistics pass (the step definition), else each micro-batch's own routing."""
    vision, llm = modules["vision"], modules["llm"]
    for m in modules.values():
        m.zero_grad(set_to_none=True)
    stats = None
    if step:
        sums = []
        with torch.no_grad():
            for mb in micro_batches:
                outs = {} if mb["pixel_values"] is None else vision(mb["pixel_values"], mb["image_grid_thw"])
                sums.append(llm(**_llm_kwargs(mb, outs), batch_statistics=True).double())
        stats = StepStatistics(values=tuple(sum(sums).tolist()), num_label_tokens=num_label_tokens)
    total = torch.zeros(())
    for mb in micro_batches:
        outs = {} if mb["pixel_values"] is None else vision(mb["pixel_values"], mb["image_grid_thw"])
        leaves = {k: v.detach().requires_grad_(True) for k, v in outs.items()}
        out = llm(**_llm_kwargs(mb, leaves), **({} if stats is None else {"step_statistics": stats}))
        (out.loss_sum / num_label_tokens).backward()
        if outs:
            torch.autograd.backward([outs[k] for k in outs], [leaves[k].grad for k in outs])
        total += out.loss_sum.detach() / num_label_tokens
    grads = {
        n: {f: p.grad for f, p in m.named_parameters() if p.grad is not None} for n, m in modules.items()
    }
    return total, grads


def grad_errors(family, grads: dict, ref_grads: dict) -> dict[tuple[str, str], float]:
    """Relative error of every parameter's gradient (both sides must hold the same parameters)."""
    mapped = {family.checkpoint_owner(name): name for name in ref_grads}
    got = {(m, f) for m, g in grads.items() for f in g}
    assert got == set(mapped), got ^ set(mapped)
    return {(m, f): relative_error(grads[m][f], ref_grads[mapped[(m, f)]]) for m, f in got}


def assert_matches(family, loss, grads, ref_loss, ref_grads, tag: str) -> None:
    assert relative_error(loss, ref_loss) <= LOSS_RTOL, (tag, loss.item(), ref_loss.item())
    errors = grad_errors(family, grads, ref_grads)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"{tag}: worst relative grad error {errors[worst]:.2e} at {worst}"
    assert any(f.endswith("mlp.gate.weight") for _, f in errors)  # the routers are among those compared


@pytest.mark.parametrize(
    "name",
    [FAST["one_rank"], *(pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES if f != FAST["one_rank"])],
)
def test_one_rank_every_micro_batch_cut_is_hf_on_the_step(name):
    family, hf_config, ref, modules = build(name)
    parts = samples(hf_config)
    pad = hf_config.text_config.pad_token_id
    whole = concat(parts, pad)
    t = label_tokens(whole)
    ref_loss, ref_grads = hf_step(ref, hf_config, whole)
    for cut in ([[0], [1], [2], [3]], [[0, 1], [2, 3]]):
        mbs = [concat([parts[i] for i in group], pad) for group in cut]
        loss, grads = split_step(modules, mbs, num_label_tokens=t, step=True)
        assert_matches(family, loss, grads, ref_loss, ref_grads, f"{name} cut {cut}")
    # the per-micro-batch definition on 4 micro-batches: another objective, visibly so
    loss, grads = split_step(modules, [concat([p], pad) for p in parts], num_label_tokens=t, step=False)
    router = next(f for f in grads["llm"] if f.endswith("mlp.gate.weight"))
    gap = relative_error(grads["llm"][router], ref_grads[family.hf_key("llm", router)])
    assert gap > 100 * GRAD_RTOL and relative_error(loss, ref_loss) > 10 * LOSS_RTOL, (gap, loss, ref_loss)


def _ranks(rank: int, world: int, name: str, per_micro_batch: int) -> None:
    """Rank ``rank`` of ``world`` (dp): its contiguous samples, ``per_micro_batch`` per micro-batch,
    the statistics pass when it has several; gradients summed over the ranks, as data parallelism does."""
    family, hf_config, ref, modules = build(name)
    modules["llm"].aux_loss_group = dist.group.WORLD
    parts = samples(hf_config)
    pad = hf_config.text_config.pad_token_id
    whole = concat(parts, pad)
    ref_loss, ref_grads = hf_step(ref, hf_config, whole)
    mine = parts[rank * len(parts) // world : (rank + 1) * len(parts) // world]
    mbs = [concat(mine[i : i + per_micro_batch], pad) for i in range(0, len(mine), per_micro_batch)]
    loss, grads = split_step(modules, mbs, num_label_tokens=label_tokens(whole), step=len(mbs) > 1)
    dist.all_reduce(loss)
    # every parameter on every rank (a rank with a text-only sample has no encoder gradient), summed
    grads = {
        n: {f: grads[n].get(f, torch.zeros_like(p)) for f, p in m.named_parameters()}
        for n, m in modules.items()
    }
    for per in grads.values():
        for g in per.values():
            dist.all_reduce(g)
    assert_matches(family, loss, grads, ref_loss, ref_grads, f"{name} dp={world} x {len(mbs)} micro-batches")


@pytest.mark.parametrize(
    "name",
    [
        FAST["two_ranks"],
        *(pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES if f != FAST["two_ranks"]),
    ],
)
def test_two_ranks_two_micro_batches_each_is_hf_on_the_step(name):
    spawn(_ranks, 2, name, 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_four_ranks_one_micro_batch_each_is_hf_on_the_step(name):
    spawn(_ranks, 4, name, 1)
