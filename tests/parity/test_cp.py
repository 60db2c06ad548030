"""Context parallelism of the LLM (``dhp.parallel.cp``) against the unsplit module, on gloo.

Each CP rank gets the whole micro-batch's token inputs (positions are computed on the whole
sequence) and only the image-embedding rows (and DeepStack rows) of its own tokens, as the hand-off
delivers them; the unsplit module gets every row. Compared: the loss (summed over the CP ranks), every
parameter's gradient after ``finalize_grads`` (SUM over cp), and the gradient of every image-embedding
row (each on the rank that owns it). Sequence lengths are odd, so the 2 x cp chunks do not divide them
(the module pads inside, masked out of attention and the loss); one batch is text-only.

The unsplit module is the family's own split module, which ``tests/parity/test_split_*`` hold equal to
transformers' whole model; ``dhp verify`` with cp > 1 compares the running plan with transformers directly.

Tolerance (fp32, CPU): loss within 1e-5 relative, every gradient within 1e-4 relative (norm sense);
the all-gather only reorders fp32 sums (measured ~1e-7).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_harness import assert_grads_match, assert_rel_close, full_grads, spawn

from dhp.layout import ParallelLayout
from dhp.ops.context import rank_index
from dhp.parallel import build_mesh, finalize_grads, parallelize

pytestmark = pytest.mark.parity

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
# (images per sample as (grid_h, grid_w) in patches, text tokens per sample)
CASES = {
    "two_images": ([[(4, 8), (4, 4)], [(2, 4)]], [5, 9]),
    "text_only": ([[], []], [13, 6]),
    "odd_len": ([[(4, 6)], []], [4, 15]),
}


def _own_rows(input_ids: torch.Tensor, placed: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Indices (into the micro-batch's row-major image rows) of the rows at the tokens ``idx`` holds, in
    the order the rank's local tokens take them (row by row, local token order)."""
    order = torch.full(placed.shape, -1, dtype=torch.long)
    order[placed] = torch.arange(int(placed.sum()))
    local = order[:, idx[idx < placed.shape[1]]]  # padding tokens past the sequence hold no rows
    return local[local >= 0]


def _forward(module, batch, rows: dict[str, torch.Tensor]):
    leaves = {k: v.clone().requires_grad_(True) for k, v in rows.items()}
    out = module(**batch, **leaves)
    return out, leaves


def _cases(rank: int, world: int, family_name: str, layout_kw: dict, extra: dict | None = None) -> None:
    from omegaconf import OmegaConf

    from dhp.models import get_family
    from dhp.models.testing import tiny_vl_batch

    family = get_family(family_name)
    model = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(family.tiny_model_config())))
    for key, value in (extra or {}).items():  # the tiny model's numbers where a case needs others
        OmegaConf.update(model, key, value)
    hf = family.hf_config(model)
    layout = ParallelLayout(cp=world // layout_kw.get("tp", 1), **layout_kw)
    mesh = build_mesh(layout, "cpu")
    torch.manual_seed(0)
    ref = family.build_module("llm", hf, device="cpu", dtype=torch.float32)
    torch.manual_seed(0)
    cp = parallelize(
        "llm",
        family.build_module("llm", hf, device="cpu", dtype=torch.float32),
        mesh,
        layout,
        activation_checkpointing="off",
        mixed_precision="fp32",
    )
    edges = [e.kwarg for e in family.handoffs_for(hf)]
    width = hf.text_config.hidden_size
    for name, (images, text_lens) in CASES.items():
        batch = tiny_vl_batch(hf, images=images, text_lens=text_lens, seed=len(name))
        del batch["pixel_values"]
        placed = batch["input_ids"] == hf.image_token_id
        n_img = int(placed.sum())
        gen = torch.Generator().manual_seed(7)
        rows = {k: torch.randn(n_img, width, generator=gen) for k in edges} if n_img else {}
        ref.zero_grad(set_to_none=True)
        cp.zero_grad(set_to_none=True)
        want, want_leaves = _forward(ref, batch, rows)
        (want.loss_sum / want.num_tokens).backward()

        seq, cp_rank = batch["input_ids"].shape[1], layout.coords(rank)["cp"]
        padded = -(-seq // layout.token_multiple) * layout.token_multiple
        own = _own_rows(batch["input_ids"], placed, rank_index(padded, layout.cp, cp_rank))
        got, got_leaves = _forward(cp, batch, {k: v[own] for k, v in rows.items()})
        cp_group = mesh["cp"].get_group()
        total = torch.tensor([float(got.num_tokens)])
        dist.all_reduce(total, group=cp_group)
        assert int(total) == want.num_tokens, name
        (got.loss_sum / want.num_tokens).backward()
        loss = got.loss_sum.detach().clone()
        dist.all_reduce(loss, group=cp_group)
        assert_rel_close(loss, want.loss_sum.detach(), rtol=LOSS_RTOL, name=f"{name} {layout} loss")
        finalize_grads(cp, mesh, layout)
        ref_grads = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
        got_grads = {k: g for k, g in full_grads(cp).items() if k in ref_grads}
        assert_grads_match(got_grads, ref_grads, rtol=GRAD_RTOL, tag=f"{name} {layout}")
        for k in rows:  # each rank holds the gradient of its own rows
            assert_rel_close(
                got_leaves[k].grad, want_leaves[k].grad[own], rtol=GRAD_RTOL, name=f"{name} d/d {k}"
            )


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_cp2_matches_the_unsplit_llm(family: str) -> None:
    """cp=2: loss, every parameter's gradient and every image (and DeepStack) row's gradient; Qwen3.5's
    Gated DeltaNet layers gather their sequence and cut their heads (``dhp.parallel.linear_attn_cp``)."""
    spawn(_cases, 2, family, {})


#: Qwen3.5 at tp x cp = 4 needs 4 key heads in its Gated DeltaNet layers (the tiny model has 2)
WIDE_DELTANET = {"llm.extra.linear_num_key_heads": 4, "llm.extra.linear_num_value_heads": 8}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "extra"), [("qwen2_5_vl", None), ("qwen3_vl", None), ("qwen3_5", WIDE_DELTANET)]
)
def test_tp2_cp2_matches_the_unsplit_llm(family: str, extra) -> None:
    """tp=2 x cp=2 (4 ranks): TP's heads cut inside each CP rank's tokens (and, in the hybrid decoder,
    the DeltaNet heads cut over tp, then each TP rank's over cp)."""
    spawn(_cases, 4, family, {"tp": 2}, extra)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_ep2_cp2_matches_the_unsplit_moe_llm(tp: int) -> None:
    """ep=2 folded over the cp=2 ranks (the token ranks EP cuts: dp x fsdp x cp x sp): each CP rank
    dispatches its own tokens to the other's experts and back; the experts' grads are summed over edp
    (1 here), the dense ones over cp. tp=2 (4 ranks): every TP rank of a CP rank runs its experts whole
    on the CP rank's tokens."""
    spawn(_cases, 2 * tp, "qwen3_vl_moe", {"ep": 2, "tp": tp})
