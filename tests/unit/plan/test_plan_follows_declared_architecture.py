"""The planner's numbers for a family come from the family's declared architecture, never from the
raw ``model.vision`` / ``model.llm`` numbers or a module's name.

A throwaway family, registered only in this test, declares an encoder of the same sizes as the tiny
Qwen2.5-VL but with window attention in EVERY block (no full-attention block) and a 3x3 merge: the
plan must follow the declaration (spans, Ulysses exchanges, kernel calls, hand-off rows), while the
raw config still says 2 full-attention blocks and a 2x2 merge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from omegaconf import DictConfig

from dhp.layout import module_layout
from dhp.models.arch import Architecture, Attention, Block, Mlp, ParamCount, uniform_blocks
from dhp.models.qwen2_5_vl.arch import ARCH as QWEN25
from dhp.models.registry import get_family, register_family, unregister_family
from dhp.plan.compile import compile_plan
from dhp.plan.memory import activations_of, module_shape
from dhp.plan.overheads import attention_calls, collectives
from dhp.plan.timing import attention_spans, link_of, module_comm, module_flops
from dhp.validation import load_config

pytestmark = pytest.mark.unit

ODD = "throwaway_all_windowed"
WINDOW, MERGE = 16, 9  # 16-patch windows; 3x3 patches per hand-off row


class AllWindowedArch:
    """The tiny Qwen2.5-VL numbers, but every encoder block windowed and a 3x3 merge."""

    module_names = ("vision", "llm")

    capabilities = QWEN25.capabilities

    def validate(self, model: DictConfig, issues) -> None:
        QWEN25.validate(model, issues)

    def module_axes(self, name: str, model: DictConfig):
        return QWEN25.module_axes(name, model)

    def architecture(self, model: DictConfig) -> Architecture:
        real = QWEN25.architecture(model)
        v = real.modules["vision"]
        a = v.blocks[0].attention
        window = Attention(
            kind="window", heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim, window=WINDOW
        )
        vision = dataclasses.replace(
            v, blocks=uniform_blocks(v.layers, window, v.blocks[0].mlp), merge=MERGE, sp_unit=WINDOW
        )
        return dataclasses.replace(real, modules={**real.modules, "vision": vision})


@pytest.fixture(scope="module")
def odd() -> Iterator[None]:
    register_family(ODD, lambda: get_family("qwen2_5_vl"), arch=AllWindowedArch())
    yield
    unregister_family(ODD)


def _cfg(family: str) -> DictConfig:
    return load_config("tiny_vlm", [f"model.family={family}"])  # vision SP=2, LLM TP=2


def _vision(cfg: DictConfig):
    return module_shape(
        "vision",
        model=cfg.model,
        module=cfg.modules["vision"],
        layout=module_layout(cfg.modules["vision"]),
        micro_batch=1,
        image_patches=64,
    )


def test_the_shape_is_the_declared_one(odd) -> None:
    cfg = _cfg(ODD)
    assert list(cfg.model.vision.extra.fullatt_block_indexes) == [1, 3]  # the raw numbers say otherwise
    shape = _vision(cfg)
    assert shape.arch == AllWindowedArch().architecture(cfg.model).modules["vision"]
    depth = cfg.model.vision.depth
    assert attention_spans(shape) == [(depth, float(WINDOW))]
    assert shape.arch.sp_exchange_blocks == 0
    # FLOPs: every block attends over a 16-patch window
    f = module_flops(shape, 64.0)
    assert f.attn_fwd == pytest.approx(4.0 * 64 * WINDOW * shape.layer.hidden * depth)
    # Ulysses SP=2 exchanges nothing in windowed blocks: only the rotary-table gather is left
    assert module_comm(shape, 64.0, link_of(cfg.cluster))["fwd"] == 0.0
    assert collectives(shape, 64.0)[0] == 1.0
    # one kernel call per window of the rank's tokens in every block
    assert attention_calls(shape, 64.0) == depth * 64 / WINDOW
    # the merger's output rows: tokens / 9
    h, out = shape.arch.hidden, shape.arch.out_width
    acts = activations_of(shape)
    a = shape.precision.act
    assert acts["merger"] == int(shape.tokens * 5 * h * a + shape.tokens / MERGE * out * a)


def test_the_real_family_differs_where_the_declarations_differ(odd) -> None:
    real, odd_shape = _vision(_cfg("qwen2_5_vl")), _vision(_cfg(ODD))
    assert real.arch.sp_exchange_blocks == 2 and odd_shape.arch.sp_exchange_blocks == 0
    link = link_of(_cfg("qwen2_5_vl").cluster)
    assert module_comm(real, 64.0, link)["fwd"] > 0.0
    assert real.params == odd_shape.params  # the same parameters: only the declared shape changed


def test_the_compiled_plan_follows_the_declaration(odd) -> None:
    real, odd_plan = compile_plan(_cfg("qwen2_5_vl")), compile_plan(_cfg(ODD))
    rv, ov = real.estimate["modules"]["vision"], odd_plan.estimate["modules"]["vision"]
    assert ov["comm_s"] < rv["comm_s"]  # no all-to-all in any block
    assert ov["fwd_s"] < rv["fwd_s"]  # window spans instead of full images in 2 blocks
    assert odd_plan.estimate["handoff_s"] < real.estimate["handoff_s"]  # 9 patches per row, not 4
    assert odd_plan.estimate["modules"]["llm"] == real.estimate["modules"]["llm"]


class HybridMoeArch:
    """The tiny LLM's sizes, declared as the next families will: every other layer linear attention
    (a recurrent state instead of scores) and a mixture of 8 experts of width 64, 2 active per token
    (their parameters counted as ``ParamCount.expert`` instead of the dense MLP's)."""

    module_names = ("vision", "llm")

    capabilities = QWEN25.capabilities
    STATE = 16 * 32  # d_k x d_v per head (head_dim 16: d_v = 32)

    def validate(self, model: DictConfig, issues) -> None:
        QWEN25.validate(model, issues)

    def module_axes(self, name: str, model: DictConfig):
        return QWEN25.module_axes(name, model)

    def architecture(self, model: DictConfig) -> Architecture:
        real = QWEN25.architecture(model)
        lm = real.modules["llm"]
        full = lm.blocks[0].attention
        linear = dataclasses.replace(full, kind="linear", state=self.STATE, causal=False, conv_kernel=4)
        moe = Mlp(kind="moe", intermediate=64, experts=8, top_k=2)
        blocks = tuple(Block(linear if i % 2 == 0 else full, moe) for i in range(lm.layers))
        h, dense_mlp = lm.hidden, lm.blocks[0].mlp.intermediate
        experts = lm.layers * moe.expert_params(h)
        params = ParamCount(
            tp_sharded=lm.params.tp_sharded - lm.layers * 3 * h * dense_mlp,
            replicated=lm.params.replicated + lm.layers * 8 * h,  # the routers
            expert=experts,
        )
        llm = dataclasses.replace(lm, blocks=blocks, params=params)
        return dataclasses.replace(real, modules={**real.modules, "llm": llm})


def test_a_hybrid_moe_llm_is_planned_from_its_declared_blocks() -> None:
    name = "throwaway_hybrid_moe"
    register_family(name, lambda: get_family("qwen2_5_vl"), arch=HybridMoeArch())
    try:
        cfg = load_config("tiny_vlm", [f"model.family={name}"])
        shape = module_shape(
            "llm",
            model=cfg.model,
            module=cfg.modules["llm"],
            layout=module_layout(cfg.modules["llm"]),
            micro_batch=1,
        )
        h, layers, seq = shape.arch.hidden, shape.arch.layers, cfg.modules["llm"].seq_len
        assert shape.layer.mlp == 2 * 64  # the active experts' width, not 8 x 64
        full, linear = shape.arch.blocks[1].attention, shape.arch.blocks[0].attention
        mlp = 3 * h * 128 + h * 8  # the 2 active experts and the router
        per_full = 2 * h * full.q_dim + 2 * h * full.kv_dim + mlp
        k, v = 4 * 16, 8 * 32  # key heads x d_k, value heads x d_v
        per_linear = h * (2 * k + v) + h * v + 2 * h * 8 + v * h + (2 * k + v) * 4 + mlp
        assert shape.arch.block_macs() == layers // 2 * (per_full + per_linear)
        # linear blocks have no scores: only the full-attention half has a span; their mixing is
        # the chunked delta rule
        assert sorted(attention_spans(shape)) == sorted([(layers // 2, 0.0), (layers // 2, seq / 2.0)])
        assert module_flops(shape, seq).linear_fwd == seq * layers // 2 * linear.delta_rule_flops() / 2
        assert shape.arch.active_params == shape.params.total - layers * 6 * 3 * h * 64
        plan = compile_plan(cfg)
        assert plan.estimate["modules"]["llm"]["fwd_s"] > 0
        assert plan.group("llm").active < plan.group("llm").param_count
    finally:
        unregister_family(name)
