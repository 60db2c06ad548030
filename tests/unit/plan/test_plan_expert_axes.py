"""The planner's terms for the expert axes ``etp`` (the TP ranks cut the experts' work) and
``expert_fsdp`` (the experts sharded over their edp ranks too), and the 235B recipe they move.

Memory: expert params + grads + AdamW states at 1/(ep x etp x edp) per rank under expert FSDP, one
MoE layer's local experts gathered (unsharded) in forward and backward, its unsharded grads before
the reduce-scatter; under etp 1/etp of the expert activations and dispatch rows, plus the MoE
output's all-gather. Time: 1/etp of the expert matmuls, an all-to-all over ep x etp ranks of 1/etp
of the rows, the output all-gather over TP; expert FSDP's gathers and reduce-scatter over edp in
place of the expert-grad all-reduce. ``--auto`` offers both axes.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
from omegaconf import DictConfig, OmegaConf

from dhp.config.plan_space import declared_axes, module_problems
from dhp.layout import module_layout
from dhp.models.registry import get_arch
from dhp.plan.compile import compile_plan
from dhp.plan.experts import dispatch_bytes, moe_summary
from dhp.plan.memory import model_states, module_shape, saved_layers_bytes
from dhp.plan.phases import module_terms
from dhp.plan.search import Search, module_degrees
from dhp.plan.timing import (
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    grad_sync_s,
    link_of,
    module_comm,
    module_flops,
)
from dhp.validation import load_config

pytestmark = pytest.mark.unit


@functools.cache
def _cfg(recipe: str, *overrides: str) -> DictConfig:
    return load_config(recipe, list(overrides))


def _llm(cfg: DictConfig, micro_batch: int = 1, ac: str | None = None, **parallel):
    mod = OmegaConf.to_container(cfg.modules.llm)
    mod["parallel"].update({"etp": 1, "expert_fsdp": False, **parallel})  # off unless asked for
    p = mod["parallel"]
    mod["gpus"] = p["dp"] * p["fsdp"] * p["sp"] * p["tp"]
    shape = module_shape(
        "llm",
        model=cfg.model,
        module=OmegaConf.create(mod),
        layout=module_layout(OmegaConf.create(mod)),
        micro_batch=micro_batch,
    )
    return shape if ac is None else dataclasses.replace(shape, ac=dataclasses.replace(shape.ac, kind=ac))


def _terms(shape):
    return module_terms(shape, micro_batches=1, optimizer_impl="fused")


def test_expert_fsdp_keeps_one_ep_etp_edp_th_of_the_expert_state_per_rank() -> None:
    cfg = _cfg("tiny_qwen3_vl_moe")
    base = _llm(cfg, dp=4, ep=2)  # edp = 2, experts replicated over it
    fsdp = _llm(cfg, dp=4, ep=2, expert_fsdp=True)
    assert fsdp.layout.expert_param_shards == 4
    experts, pr = base.params.expert, base.precision
    assert experts > 0
    p0, g0, o0 = model_states(base)
    p1, g1, o1 = model_states(fsdp)
    # params and grads: from 1/ep to 1/(ep x edp) of the experts; the states the same
    assert p0 - p1 == pytest.approx((experts / 2 - experts / 4) * pr.param, abs=2)
    assert g0 - g1 == pytest.approx((experts / 2 - experts / 4) * pr.grad, abs=2)
    assert o0 - o1 == pytest.approx((experts / 2 - experts / 4) * pr.optimizer, abs=2)
    # ZeRO-1 already cuts the states over edp: expert FSDP adds the params and grads, not the states
    zero = model_states(_llm(cfg, dp=4, ep=2, zero=1))
    both = model_states(_llm(cfg, dp=4, ep=2, zero=1, expert_fsdp=True))
    assert both[2] == zero[2] and both[0] < zero[0]
    # with etp = tp = 2 as well: 1/(ep x etp x edp) = 1/8 of the experts on each of 8 ranks
    etp = _llm(cfg, dp=4, tp=2, ep=2, etp=2, expert_fsdp=True)
    assert etp.layout.expert_param_shards == 8
    dense = etp.params.per_tp_rank(2) - experts
    assert model_states(etp)[0] == int((dense + experts / 8) * pr.param)
    moe = moe_summary(etp, _terms(etp), micro_batches=1, optimizer_impl="fused")
    assert moe["expert_params_per_rank"] == int(experts / 8) and moe["experts_per_rank"] == 8 // 4
    assert moe["expert_fsdp"] and moe["etp"] == 2


def test_expert_fsdp_gathers_one_moe_layers_local_experts_in_forward_and_backward() -> None:
    cfg = _cfg("tiny_qwen3_vl_moe")
    base = _llm(cfg, dp=4, ep=2)
    fsdp = _llm(cfg, dp=4, ep=2, expert_fsdp=True)
    layer = fsdp.layer_params.expert / 2  # one MoE layer's experts of an EP rank, unsharded
    a, reduce = fsdp.precision.act, fsdp.precision.reduce
    t0, t1 = _terms(base), _terms(fsdp)
    assert "expert_fsdp_gather" not in t0.fwd_work and "expert_fsdp_gather" not in t0.bwd_work
    assert t1.fwd_work["expert_fsdp_gather"] == int(2 * layer * a)  # the layer and the prefetched one
    assert t1.bwd_work["expert_fsdp_gather"] == int(2 * layer * a)
    assert t1.bwd_work["expert_fsdp_reduce_scatter"] == int(layer * reduce)
    # the expert-grad all-reduce buffer of the finish is gone (reduce-scattered in backward); at
    # fsdp=4 the dense grads are FSDP's, so that buffer is the experts' alone
    s0 = _terms(_llm(cfg, fsdp=4, ep=2)).sync
    s1 = _terms(_llm(cfg, fsdp=4, ep=2, expert_fsdp=True)).sync
    assert (s0, s1) == (int(base.params.expert / 2 * base.precision.grad), 0)


def test_expert_tp_halves_the_expert_work_rows_and_buffers_of_a_rank() -> None:
    cfg = _cfg("tiny_qwen3_vl_moe")
    one = _llm(cfg, ac="off", dp=2, tp=2, ep=2)
    two = _llm(cfg, ac="off", dp=2, tp=2, ep=2, etp=2)
    arch, t = one.arch, 512.0
    experts = arch.expert_macs()
    # matmul: the routed experts' 2 T N_experts is halved; nothing else moves
    assert module_flops(one, t).matmul_fwd - module_flops(two, t).matmul_fwd == pytest.approx(
        2 * t * experts / 2, rel=1e-9
    )
    # the dispatch and combine buffers and what AC off keeps of them: halved
    b1, s1 = dispatch_bytes(one, 1.0)
    b2, s2 = dispatch_bytes(two, 1.0)
    assert b1 > 0 and s1 > 0
    assert (b2, s2) == (pytest.approx(b1 / 2, abs=1), pytest.approx(s1 / 2, abs=1))
    # the saved expert activations: the routed part of every MoE block halved
    assert saved_layers_bytes(two) < saved_layers_bytes(one)
    # the MoE output all-gathered over TP: T x h in the compute dtype, forward and backward
    gathered = int(one.tokens * arch.hidden * one.precision.act)
    assert _terms(two).fwd_work["etp_output_gather"] == gathered
    assert "etp_output_gather" not in _terms(one).fwd_work


def test_expert_tp_all_to_all_runs_over_ep_x_etp_ranks_with_1_over_etp_of_the_rows() -> None:
    cfg = _cfg("qwen3_vl_235b_a22b")  # 8 GPUs a node
    link = link_of(cfg.cluster)
    t = 4096.0
    one = _llm(cfg, ac="off", fsdp=16, tp=2, ep=4)
    two = _llm(cfg, ac="off", fsdp=16, tp=2, ep=4, etp=2)
    m = next(b.mlp for b in one.arch.blocks if b.mlp.kind == "moe")
    rows = t * m.top_k * one.arch.hidden * one.precision.act
    blocks = one.arch.moe_blocks
    c1, c2 = module_comm(one, t, link), module_comm(two, t, link)
    assert c1["a2a"] == pytest.approx(blocks * 4 * all_to_all_s(rows, 4, link.intra, link.lat))
    assert c2["a2a"] == pytest.approx(blocks * 4 * all_to_all_s(rows / 2, 8, link.intra, link.lat))
    assert c2["a2a"] < c1["a2a"]
    # the output all-gather over TP: once per MoE block forward, its reverse in backward (AC off)
    gather = all_gather_s(t * one.arch.hidden * one.precision.act, 2, link.intra, link.lat)
    assert c2["fwd"] - c2["a2a"] / 2 - (c1["fwd"] - c1["a2a"] / 2) == pytest.approx(blocks * gather)
    assert c2["bwd"] - c2["a2a"] / 2 - (c1["bwd"] - c1["a2a"] / 2) == pytest.approx(blocks * gather)


def test_expert_fsdp_collectives_cross_the_nodes_and_replace_the_expert_grad_all_reduce() -> None:
    cfg = _cfg("qwen3_vl_235b_a22b")  # 4 nodes of 8
    link = link_of(cfg.cluster)
    t = 4096.0
    base = _llm(cfg, fsdp=32, ep=8)
    fsdp = _llm(cfg, fsdp=32, ep=8, expert_fsdp=True)
    lay = fsdp.layout
    assert (lay.edp, lay.ep_span) == (4, 8)  # edp ranks 8 GPUs apart: one per node
    blocks = fsdp.arch.moe_blocks
    per_block = fsdp.params.expert / blocks / 8
    pr = fsdp.precision
    expect = blocks * (
        2 * all_gather_s(per_block * pr.act, 4, link.inter, link.lat)
        + all_gather_s(per_block * pr.reduce, 4, link.inter, link.lat)
    )
    assert module_comm(fsdp, t, link)["fsdp"] - module_comm(base, t, link)["fsdp"] == pytest.approx(expect)
    # the finish loses the experts' all-reduce over edp, nothing else
    world = lay.world_size
    ar = all_reduce_s(base.params.expert / 8 * pr.grad, 4, link.bw(world), link.lat)
    assert grad_sync_s(base, link, world) - grad_sync_s(fsdp, link, world) == pytest.approx(ar)
    # ZeRO-1's expert broadcast over edp goes too under expert FSDP
    z = lambda **k: grad_sync_s(_llm(cfg, dp=4, fsdp=8, ep=8, zero=1, **k), link, world)  # noqa: E731
    assert z() > z(expert_fsdp=True)


OLD_8_NODES = (
    "cluster=h100_8x8",
    "modules.vision.gpus=64",
    "modules.vision.parallel.dp=8",
    "modules.vision.seq_len=16384",
    "modules.llm.gpus=64",
    "modules.llm.parallel.fsdp=64",
    "modules.llm.parallel.ep=64",
    "modules.llm.parallel.expert_fsdp=false",
    "modules.llm.mixed_precision=bf16_master_fp32",
    "train.micro_batch_size=1",
)


def test_the_235b_recipe_fits_on_fewer_nodes_with_a_shorter_step_than_ep64_on_8() -> None:
    """The recipe keeps its all-to-all inside a node (ep x tp <= gpus_per_node) with expert FSDP, on
    fewer than 8 nodes, and plans a shorter step than the 8-node fp32 EP=64 plan it replaced."""
    new_cfg, old_cfg = _cfg("qwen3_vl_235b_a22b"), _cfg("qwen3_vl_235b_a22b", *OLD_8_NODES)
    new, old = compile_plan(new_cfg), compile_plan(old_cfg)
    assert new.fits and old.fits
    assert new_cfg.cluster.nodes < 8 == old_cfg.cluster.nodes
    lay = module_layout(new_cfg.modules.llm)
    assert lay.expert_fsdp and lay.ep_span <= new_cfg.cluster.gpus_per_node
    assert module_layout(old_cfg.modules.llm).ep == 64
    assert new.estimate["step_time_s"] < old.estimate["step_time_s"]
    a2a = lambda p: p.estimate["modules"]["llm"]["a2a_s"]  # noqa: E731
    assert a2a(new) < a2a(old)


def test_auto_offers_expert_fsdp_and_expert_tp_for_an_moe_module_and_only_valid_ones() -> None:
    cfg = _cfg("tiny_qwen3_vl_moe")
    arch = get_arch(cfg.model.family)
    axes = declared_axes(arch, "llm", cfg.model)
    degs = module_degrees("llm", 8, axes=axes, gpus_per_node=8, mixed_precision="fp32")
    assert any(d.expert_fsdp for d in degs) and any(d.etp > 1 for d in degs)
    assert any(d.expert_fsdp and d.etp > 1 for d in degs)
    for d in degs:  # every one is valid: etp in {1, tp}, edp > 1 under expert FSDP
        assert d.etp in (1, d.tp) and (not d.expert_fsdp or d.edp > 1)
        assert not module_problems(
            "llm", gpus=8, layout=d, axes=axes, gpus_per_node=8, activation_checkpointing="off",
            mixed_precision="fp32",
        )  # fmt: skip
    vision = declared_axes(arch, "vision", cfg.model)
    vdegs = module_degrees("vision", 8, axes=vision, gpus_per_node=8, mixed_precision="fp32")
    assert not any(d.expert_fsdp or d.etp > 1 for d in vdegs)  # no MoE blocks, no expert axes
    # the search itself ranks such candidates among the plans that fit
    fixed = {
        "placement",
        "train.micro_batch_size",
        "modules.vision.gpus",
        "modules.vision.activation_checkpointing",
    }
    found = Search(cfg, fixed).run()
    assert any(c.llm.degrees.expert_fsdp for c in found) and any("efsdp" in c.label() for c in found)
