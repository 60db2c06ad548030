"""The planner's context-parallel terms (``dhp.parallel.cp``, ``dhp.parallel.linear_attn_cp``): each
LLM rank's tokens at 1/cp of the padded rows, a full block's gathered K/V and context mask, a linear
block's gathered sequence and its chunk states at 1/cp of the heads, the CP collectives on the cp
ranks' link, the checkpointed attention's extra forward, the cp gradient all-reduce, and the search
enumerating cp. Each assertion pins one term by its formula, so removing the term fails it."""

from __future__ import annotations

import dataclasses

import pytest

from dhp.config.plan_space import declared_axes
from dhp.layout import ParallelLayout
from dhp.models import get_arch
from dhp.plan.compile import module_shapes
from dhp.plan.memory import activations_of, delta_rule_work_bytes
from dhp.plan.phases import module_terms
from dhp.plan.search import module_degrees
from dhp.plan.timing import Link, all_gather_s, all_reduce_s, grad_sync_s, module_comm, module_flops
from dhp.validation import load_config

pytestmark = pytest.mark.unit

BW, LAT = 1e9, 1e-6


def _llm(recipe: str, *, seq: int, cp: int, tp: int = 1, ac: str = "off", extra: tuple[str, ...] = ()):
    over = [
        "placement=disaggregated", "modules.vision.gpus=1", "modules.vision.parallel.sp=1",
        f"modules.llm.gpus={cp * tp}", f"modules.llm.parallel.cp={cp}", f"modules.llm.parallel.tp={tp}",
        "modules.llm.parallel.dp=1", "modules.llm.parallel.fsdp=1", "modules.llm.parallel.ep=1",
        "modules.llm.parallel.zero=0", "modules.llm.parallel.sequence_parallel=false",
        f"modules.llm.seq_len={seq}", f"modules.llm.activation_checkpointing={ac}",
        "modules.llm.mixed_precision=fp32", "train.micro_batch_size=1", "train.global_batch_size=4",
        "data.packing=false", "cluster.gpus_per_node=8", *extra,
    ]  # fmt: skip
    return module_shapes(load_config(recipe, over))["llm"]


def test_tokens_are_a_cp_ranks_share_of_the_padded_row() -> None:
    one = _llm("tiny_vlm", seq=511, cp=1)
    two = _llm("tiny_vlm", seq=511, cp=2)
    four = _llm("tiny_vlm", seq=511, cp=4)
    assert one.tokens == 511  # no CP: no padding
    assert two.row_len == 512 and two.tokens == 256  # padded to 2 x cp = 4, then 1/cp
    assert four.row_len == 512 and four.tokens == 128  # padded to 8
    # every per-token saved term follows: the blocks' activations at 1/cp
    assert activations_of(two)["layers"] == pytest.approx(activations_of(one)["layers"] * 256 / 511, rel=1e-6)


def test_a_full_blocks_gathered_kv_and_mask() -> None:
    s = _llm("tiny_vlm", seq=512, cp=2)
    kv, a = s.layer.kv_dim, s.precision.act
    t = module_terms(s, micro_batches=1, optimizer_impl="fused")
    gathered = 512 * 2 * kv * a  # K and V of the whole row, all-gathered
    bias = 256 * 512 * a  # sdpa's additive bias of the boolean mask: S/cp queries x S keys
    assert t.fwd_work["cp_gather"] == gathered + bias
    assert t.bwd_work["cp_gather"] == 2 * gathered + bias  # re-gathered + their gradients
    assert activations_of(s)["cp_mask"] == 256 * 512  # the boolean mask, kept for the recompute
    tp2 = module_terms(_llm("tiny_vlm", seq=512, cp=2, tp=2), micro_batches=1, optimizer_impl="fused")
    assert tp2.fwd_work["cp_gather"] == gathered / 2 + bias  # kv heads / tp
    none = module_terms(_llm("tiny_vlm", seq=512, cp=1), micro_batches=1, optimizer_impl="fused")
    assert "cp_gather" not in none.fwd_work and "cp_mask" not in activations_of(
        _llm("tiny_vlm", seq=512, cp=1)
    )


def test_linear_blocks_gather_the_sequence_and_cut_their_heads() -> None:
    one = _llm("tiny_qwen3_5", seq=512, cp=1)
    two = _llm("tiny_qwen3_5", seq=512, cp=2)
    h, a = two.arch.hidden, two.precision.act
    n_lin = two.arch.count("linear")
    # saved: the blocks at 1/cp of the tokens + each linear block's gathered input beyond its own ((cp-1) h)
    half = dataclasses.replace(one, seq_len=256)
    assert activations_of(two)["layers"] == pytest.approx(
        activations_of(half)["layers"] + n_lin * 256 * (2 - 1) * h * a, rel=1e-9
    )
    # the chunk states: the whole row, 1/cp of the heads -> half of the unsplit module's
    assert delta_rule_work_bytes(two) == pytest.approx(delta_rule_work_bytes(one) / 2, rel=0.02)
    t = module_terms(two, micro_batches=1, optimizer_impl="fused")
    full = 512 * 2 * two.layer.kv_dim * a + 256 * 512 * a
    assert t.fwd_work["cp_gather"] == max(full, 2 * 512 * h * a)


def test_cp_collectives_on_the_cp_ranks_link() -> None:
    s = _llm("tiny_vlm", seq=512, cp=2)
    kv, a, layers = s.layer.kv_dim, s.precision.act, s.arch.layers
    link = Link(intra=BW, inter=BW / 10, lat=LAT, gpn=8)
    c = module_comm(s, s.tokens, link)
    one = 512 * 2 * kv * a
    assert c["fwd"] == pytest.approx(layers * all_gather_s(one, 2, BW, LAT))
    assert c["bwd"] == pytest.approx(layers * (all_gather_s(one, 2, BW, LAT) + all_reduce_s(one, 2, BW, LAT)))
    across = module_comm(s, s.tokens, Link(intra=BW, inter=BW / 10, lat=LAT, gpn=1))  # cp spans 2 nodes
    assert across["fwd"] == pytest.approx(layers * all_gather_s(one, 2, BW / 10, LAT))
    full = module_comm(_llm("tiny_vlm", seq=512, cp=2, ac="full"), s.tokens, link)
    assert full["bwd"] == pytest.approx(c["bwd"] + c["fwd"])  # AC re-runs the forward's gathers
    assert module_comm(_llm("tiny_vlm", seq=512, cp=1), 512, link)["fwd"] == 0.0


def test_linear_block_collectives() -> None:
    s = _llm("tiny_qwen3_5", seq=512, cp=2)
    a, h = s.precision.act, s.arch.hidden
    n_lin = s.arch.count("linear")
    n_full = s.arch.layers - n_lin
    link = Link(intra=BW, inter=BW, lat=LAT, gpn=8)
    kv = 512 * 2 * s.layer.kv_dim * a
    x = 512 * h * a
    want = n_full * all_gather_s(kv, 2, BW, LAT) + n_lin * (
        all_gather_s(x, 2, BW, LAT) + all_reduce_s(x, 2, BW, LAT)
    )
    assert module_comm(s, s.tokens, link)["fwd"] == pytest.approx(want)


def test_cp_attention_span_and_recompute() -> None:
    one = _llm("tiny_vlm", seq=512, cp=1)
    two = _llm("tiny_vlm", seq=512, cp=2)
    f1, f2 = module_flops(one, one.tokens), module_flops(two, two.tokens)
    # each rank: half the queries, each over the whole masked row (the kernel skips no masked score):
    # the same attention FLOPs as the unsplit causal module, equal on every rank
    assert f2.attn_fwd == pytest.approx(f1.attn_fwd)
    assert f2.attn_span == 512 and f1.attn_span == 256
    assert f2.recompute_attn == pytest.approx(f2.attn_fwd)  # the checkpointed attention's forward again
    assert f1.recompute_attn == 0
    assert f2.matmul_fwd == pytest.approx(f1.matmul_fwd / 2)


def test_cp_grads_are_all_reduced_once_a_step() -> None:
    s = _llm("tiny_vlm", seq=512, cp=2)
    link = Link(intra=BW, inter=BW, lat=LAT, gpn=8)
    local = s.params.per_tp_rank(1)
    assert grad_sync_s(s, link, world=2) == pytest.approx(all_reduce_s(local * 4, 2, BW, LAT))
    assert module_terms(s, micro_batches=1, optimizer_impl="fused").sync == int(local * 4)


@pytest.mark.parametrize("recipe", ["tiny_vlm", "tiny_qwen3_vl", "tiny_qwen3_5", "tiny_qwen3_vl_moe"])
def test_the_search_enumerates_cp_for_the_llm(recipe: str) -> None:
    cfg = load_config(recipe, [])
    arch = get_arch(cfg.model.family)
    degs = module_degrees(
        "llm", 4, axes=declared_axes(arch, "llm", cfg.model), gpus_per_node=4, mixed_precision="fp32"
    )
    assert {d.cp for d in degs} >= {1, 2}
    assert all(d.world_size == 4 for d in degs)
    vision = module_degrees(
        "vision", 4, axes=declared_axes(arch, "vision", cfg.model), gpus_per_node=4, mixed_precision="fp32"
    )
    assert {d.cp for d in vision} == {1}


def test_cp_layout_padding() -> None:
    lay = ParallelLayout(cp=4)
    assert lay.padded_tokens(1000) == 1000 and lay.cp_rank_tokens(1000) == 250
    assert lay.padded_tokens(1001) == 1008 and lay.cp_rank_tokens(1001) == 252
    assert ParallelLayout().cp_rank_tokens(1001) == 1001
