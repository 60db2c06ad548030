"""The planner's mixture-of-experts terms, read from the family's typed architecture (Qwen3-VL-MoE).

Total vs active parameters; the routed experts' states per rank at each EP degree (1/ep, whole on
every TP rank, params and grads replicated over edp: FSDP does not divide them, ZeRO-1 partitions
their AdamW states over edp); the dispatch/combine
buffers with a balanced router (the verdict's) and a fully unbalanced one; FLOPs from the active
experts only; the all-to-all time per MoE block over the link the EP group spans; ``--auto``'s ep.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json

import pytest
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from dhp.config.plan_space import declared_axes
from dhp.layout import module_layout
from dhp.models.registry import get_arch
from dhp.plan.compile import compile_plan
from dhp.plan.experts import moe_summary
from dhp.plan.memory import model_states, module_shape, saved_layers_bytes
from dhp.plan.phases import module_terms
from dhp.plan.render import render_plan
from dhp.plan.search import module_degrees
from dhp.plan.timing import all_to_all_s, link_of, module_comm, module_flops
from dhp.validation import load_config

pytestmark = pytest.mark.unit


@functools.cache
def _cfg(recipe: str) -> DictConfig:
    return load_config(recipe, [])


def _llm(cfg: DictConfig, micro_batch: int = 1, **parallel):
    mod = OmegaConf.to_container(cfg.modules.llm)
    mod["parallel"].update(parallel)
    p = mod["parallel"]
    mod["gpus"] = p["dp"] * p["fsdp"] * p["sp"] * p["tp"]
    return module_shape(
        "llm",
        model=cfg.model,
        module=OmegaConf.create(mod),
        layout=module_layout(OmegaConf.create(mod)),
        micro_batch=micro_batch,
    )


def test_total_and_active_parameters_are_printed_and_emitted() -> None:
    cfg = _cfg("qwen3_vl_30b_a3b")
    arch = get_arch(cfg.model.family).architecture(cfg.model).modules["llm"]
    idle = sum((b.mlp.experts - b.mlp.top_k) * 3 * arch.hidden * b.mlp.intermediate for b in arch.blocks)
    plan = compile_plan(cfg, estimate=False)
    llm = plan.group("llm")
    assert llm.param_count == arch.params.total and llm.active == arch.params.total - idle
    assert 30e9 < llm.param_count < 31.5e9 and 3e9 < llm.active < 3.5e9  # "30B-A3B"
    doc = json.loads(plan.to_json_str())
    group = next(g for g in doc["groups"] if g["name"] == "llm")
    assert (group["param_count"], group["active_param_count"]) == (llm.param_count, llm.active)
    moe = group["ranks"][0]["memory"]["moe"]
    assert moe["ep"] == 8 and moe["experts_per_rank"] == 16 and moe["verdict_uses"] == "balanced"
    out = io.StringIO()
    render_plan(plan, console=Console(file=out, width=250))
    text = out.getvalue()
    assert f"{llm.param_count / 1e9:.2f}B / {llm.active / 1e9:.2f}B" in text
    assert "fully unbalanced" in text and "the verdict uses the balanced router's" in text


def test_expert_states_are_one_ep_th_fsdp_leaves_them_and_zero1_splits_their_states_over_edp() -> None:
    cfg = _cfg("tiny_qwen3_vl_moe")
    experts = _llm(cfg, dp=2, ep=1).params.expert
    assert experts > 0
    pr = _llm(cfg, dp=2, ep=1).precision
    p1, g1, o1 = model_states(_llm(cfg, dp=2, ep=1))
    p2, g2, o2 = model_states(_llm(cfg, dp=2, ep=2))
    # ep=2 holds half of the experts: their params, grads and optimizer states
    assert p1 - p2 == pytest.approx(experts / 2 * pr.param, abs=2)
    assert o1 - o2 == pytest.approx(experts / 2 * pr.optimizer, abs=2)
    assert g1 - g2 == pytest.approx(experts / 2 * pr.grad, abs=2)
    # FSDP=2 shards the other parameters only
    fsdp = _llm(cfg, dp=1, fsdp=2, ep=2)
    dense = fsdp.params.per_tp_rank(1) - experts
    assert model_states(fsdp)[0] == int((dense / 2 + experts / 2) * fsdp.precision.param)
    # ZeRO-1: the others' states over dp; the experts' over edp = dp / ep (edp=1 at dp=ep=2)
    zero = _llm(cfg, dp=2, ep=2, zero=1)
    assert model_states(zero)[2] == int((dense / 2 + experts / 2) * zero.precision.optimizer)
    zero4 = _llm(cfg, dp=4, ep=2, zero=1)  # edp = 2: 1/(ep x edp) of the experts' states
    assert model_states(zero4)[2] == int((dense / 4 + experts / 4) * zero4.precision.optimizer)
    assert model_states(zero4)[:2] == model_states(_llm(cfg, dp=4, ep=2))[:2]  # params, grads as zero=0
    by_ep = moe_summary(zero4, module_terms(zero4, micro_batches=1, optimizer_impl="fused"), micro_batches=1,
                        optimizer_impl="fused")["expert_state_bytes_by_ep"]  # fmt: skip
    pp, pg, po = zero4.precision.param, zero4.precision.grad, zero4.precision.optimizer
    assert by_ep == {str(e): int(experts / e * (pp + pg + po / (4 // e))) for e in (1, 2, 4)}
    # the summary's per-ep table is the same arithmetic
    s = _llm(cfg, dp=2, ep=2)
    summary = moe_summary(s, module_terms(s, micro_batches=1, optimizer_impl="fused"), micro_batches=1,
                          optimizer_impl="fused")  # fmt: skip
    per = pr.param + pr.grad + pr.optimizer
    assert summary["expert_state_bytes_by_ep"] == {"1": int(experts * per), "2": int(experts / 2 * per)}


def test_dispatch_buffers_balanced_for_the_verdict_and_the_worst_case_beside_it() -> None:
    cfg = _cfg("tiny_qwen3_vl_moe")
    shape = _llm(cfg, dp=2, ep=2)
    shape = dataclasses.replace(shape, ac=dataclasses.replace(shape.ac, kind="off"))
    worst = dataclasses.replace(shape, moe_received=2.0)
    moe = [b.mlp for b in shape.arch.blocks if b.mlp.kind == "moe"]
    h = shape.arch.hidden
    # r = 2 receives twice the rows: the rows regrouped by expert (k h) and the experts'
    # activations (4 k I) double, and the two int64 permutations of the received rows (8 bytes, k each)
    a = shape.precision.act
    extra = sum(m.top_k * h + 4 * m.top_k * m.intermediate + 2 * 8 * m.top_k / a for m in moe)
    assert saved_layers_bytes(worst) - saved_layers_bytes(shape) == pytest.approx(
        shape.tokens * extra * a, rel=1e-9
    )
    plan = compile_plan(load_config("tiny_qwen3_vl_moe", ["modules.llm.activation_checkpointing=off"]))
    for d in plan.devices:  # the verdict counts the balanced router's; the worst case is beside it
        assert d.worst_case_total > d.total
        assert d.fits == (d.total <= d.budget)


def test_flops_count_the_active_experts_only() -> None:
    cfg = _cfg("qwen3_vl_30b_a3b")
    shape = _llm(cfg, dp=8, ep=8)
    arch, h = shape.arch, shape.arch.hidden
    moe = next(b for b in arch.blocks if b.mlp.kind == "moe")
    m = moe.mlp
    assert m.macs(h) == 3 * h * m.intermediate * m.top_k + h * m.experts  # top-8 of 128, + router
    fl = module_flops(shape, 4096.0)
    attn = sum(b.attention.proj_macs(h) for b in arch.blocks)
    mlp = sum(b.mlp.macs(h) for b in arch.blocks)
    assert fl.matmul_fwd == pytest.approx(2 * 4096 * (attn + mlp + arch.head_macs), rel=1e-12)
    # under TP the experts are whole on every TP rank: only the rest divides by tp
    tp2 = module_flops(_llm(cfg, dp=4, tp=2, ep=4), 4096.0)
    experts = sum(b.mlp.expert_macs(h) for b in arch.blocks)
    expect = 2 * 4096 * ((attn + mlp - experts + arch.head_macs) / 2 + experts)
    assert tp2.matmul_fwd == pytest.approx(expect, rel=1e-12)


def test_all_to_all_per_moe_block_on_the_link_the_ep_group_spans() -> None:
    cfg = _cfg("qwen3_vl_235b_a22b")  # 8 nodes of 8 H100s
    link = link_of(cfg.cluster)
    t = 4096.0

    def a2a(**par) -> float:
        return module_comm(_llm(cfg, **par), t, link)["a2a"]

    shape = _llm(cfg, fsdp=64, ep=8)
    m = next(b.mlp for b in shape.arch.blocks if b.mlp.kind == "moe")
    nbytes = t * m.top_k * shape.arch.hidden * shape.precision.act
    blocks = shape.arch.moe_blocks
    ck = 1.0 if shape.ac.kind == "full" else 0.0  # full AC re-issues the forward's two
    # ep=8 x tp=1 sits in one node: NVLink; ep=16 spans two nodes: the per-GPU inter-node link
    assert a2a(fsdp=64, ep=8) == pytest.approx(
        blocks * (4 + 2 * ck) * all_to_all_s(nbytes, 8, link.intra, link.lat)
    )
    assert a2a(fsdp=64, ep=16) == pytest.approx(
        blocks * (4 + 2 * ck) * all_to_all_s(nbytes, 16, link.inter, link.lat)
    )
    assert a2a(fsdp=64, ep=1) == 0.0
    # ep=4 with tp=2: the group's 4 ranks are strided by tp, so it spans 8 GPUs: still one node
    assert a2a(fsdp=16, tp=2, ep=4, dp=2) == pytest.approx(
        blocks * (4 + 2 * ck) * all_to_all_s(nbytes, 4, link.intra, link.lat)
    )


def test_auto_searches_ep_with_the_other_axes() -> None:
    cfg = _cfg("tiny_qwen3_vl_moe")
    axes = declared_axes(get_arch(cfg.model.family), "llm", cfg.model)
    degs = module_degrees("llm", 4, axes=axes, gpus_per_node=4, mixed_precision="fp32")
    eps = {(d.dp * d.fsdp * d.sp, d.ep) for d in degs}
    assert {(4, 1), (4, 2), (4, 4), (2, 2)} <= eps  # ep over dp x fsdp x sp, any divisor of it
    assert all((d.dp * d.fsdp * d.sp) % d.ep == 0 for d in degs)
    vision = declared_axes(get_arch(cfg.model.family), "vision", cfg.model)
    assert {
        d.ep for d in module_degrees("vision", 4, axes=vision, gpus_per_node=4, mixed_precision="fp32")
    } == {1}


def test_selective_ac_recomputes_the_exchanges_in_time_calls_and_memory() -> None:
    """Selective AC keeps matmul outputs only (``dhp.parallel.ac.SELECTIVE_SAVE``), so backward re-issues
    each MoE block's count exchange, dispatch and combine (``tests/parity/test_ep.py``: 8 all-to-alls
    per MoE layer and step, as under full AC) and nothing of them is kept for backward."""
    from dhp.plan.experts import dispatch_bytes
    from dhp.plan.overheads import collectives

    cfg = _cfg("qwen3_5_35b_a3b")
    link = link_of(cfg.cluster)
    shapes = {}
    for ac in ("off", "selective", "full"):
        s = _llm(cfg, fsdp=8, ep=8)
        shapes[ac] = dataclasses.replace(s, ac=dataclasses.replace(s.ac, kind=ac))
    t = 4096.0
    m = next(b.mlp for b in shapes["off"].arch.blocks if b.mlp.kind == "moe")
    one = all_to_all_s(
        t * m.top_k * shapes["off"].arch.hidden * shapes["off"].precision.act, 8, link.intra, link.lat
    )
    blocks = shapes["off"].arch.moe_blocks
    for ac, per_block in (("off", 4), ("selective", 6), ("full", 6)):
        assert module_comm(shapes[ac], t, link)["a2a"] == pytest.approx(blocks * per_block * one)
    ep_calls = {ac: collectives(shapes[ac], t)[1] for ac in shapes}
    assert ep_calls["selective"] - ep_calls["off"] == pytest.approx(3 * blocks)
    assert dispatch_bytes(shapes["off"], 1.0)[1] > 0
    assert dispatch_bytes(shapes["selective"], 1.0)[1] == dispatch_bytes(shapes["full"], 1.0)[1] == 0
