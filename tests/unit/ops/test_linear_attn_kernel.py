"""The linear-attention kernel selector: the name per device and environment, the rule it shares with
transformers' own dispatcher, and where the name shows (plan output, metrics)."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf
from transformers.integrations import hub_kernels

from dhp.errors import PlanError
from dhp.metrics.record import module_kernels
from dhp.models.arch import Architecture, Attention, Block, Mlp
from dhp.models.registry import get_arch, register_family, unregister_family
from dhp.ops import linear_attn
from dhp.ops.linear_attn import (
    FLA_CHUNK,
    FLA_CHUNK_TORCH_CONV,
    TORCH_FALLBACK,
    is_slow_fallback,
    kernel_note,
    linear_attention_kernel,
    planned_kernel,
    require_kernel,
)
from dhp.plan import compile_plan
from dhp.plan.render import groups_table
from dhp.validation import load_config

pytestmark = pytest.mark.unit

HAVE_FLA = linear_attn._importable(*linear_attn.DELTA_RULE_KERNEL)


def test_cpu_runs_the_torch_fallback_and_that_is_not_slow_there() -> None:
    assert linear_attention_kernel("cpu") == TORCH_FALLBACK
    assert not is_slow_fallback("cpu", TORCH_FALLBACK)
    assert kernel_note("cpu", TORCH_FALLBACK) == TORCH_FALLBACK


@pytest.mark.skipif(HAVE_FLA, reason="flash-linear-attention is installed here")
def test_cuda_without_the_gpu_extra_is_a_named_slow_fallback() -> None:
    kernel = linear_attention_kernel("cuda")
    assert kernel == TORCH_FALLBACK and is_slow_fallback("cuda", kernel)
    assert "SLOW on cuda" in kernel_note("cuda", kernel) and "dhp[gpu]" in kernel_note("cuda", kernel)


def test_the_name_follows_which_kernel_imports(monkeypatch) -> None:
    # the kernel packages need CUDA/triton to import, so which one is importable is set here by hand
    present: set = set()
    monkeypatch.setattr(linear_attn, "_importable", lambda mod, attr: (mod, attr) in present)
    assert linear_attention_kernel("cuda") == TORCH_FALLBACK
    present.add(linear_attn.DELTA_RULE_KERNEL)
    assert linear_attention_kernel("cuda") == FLA_CHUNK_TORCH_CONV
    assert "causal-conv1d not importable" in kernel_note("cuda", FLA_CHUNK_TORCH_CONV)
    present.add(linear_attn.CONV1D_KERNEL)
    assert linear_attention_kernel("cuda") == FLA_CHUNK and not is_slow_fallback("cuda", FLA_CHUNK)
    assert linear_attention_kernel("cpu") == TORCH_FALLBACK  # the kernels never run on CPU inputs


def test_same_rule_as_transformers_dispatcher() -> None:
    """The selector mirrors transformers' dispatcher; a transformers upgrade that moves it fails here."""
    mod, attr = linear_attn.DELTA_RULE_KERNEL
    assert f"fla.{hub_kernels._KERNELS_INTERNAL_PATH_MAPPINGS[attr]}" == mod
    assert linear_attn.CONV1D_KERNEL == ("causal_conv1d", "causal_conv1d_fn")
    for package in ("fla", "causal_conv1d"):
        assert set(linear_attn.KERNEL_DEVICES) <= set(hub_kernels._PACKAGE_SUPPORTED_DEVICES[package])


class _LinearLLM:
    """qwen2_5_vl's architecture with the LLM's first block made a linear-attention block."""

    def __getattr__(self, name):
        return getattr(get_arch("qwen2_5_vl"), name)

    def architecture(self, model) -> Architecture:
        arch = get_arch("qwen2_5_vl").architecture(model)
        llm = arch.modules["llm"]
        first = Block(Attention(kind="linear", heads=4, kv_heads=4, head_dim=8, state=64), Mlp("dense", 16))
        llm = dataclasses.replace(llm, blocks=(first, *llm.blocks[1:]))
        return dataclasses.replace(arch, modules={**arch.modules, "llm": llm})


def test_module_kernels_name_only_modules_with_linear_attention() -> None:
    cfg = load_config("tiny_vlm", [])
    assert module_kernels(cfg.model, module="llm", device_type="cpu") == {}
    register_family("linear_test", lambda: None, arch=_LinearLLM())
    try:
        model = OmegaConf.merge(cfg.model, {"family": "linear_test"})
        assert module_kernels(model, module="llm", device_type="cpu") == {"linear_attention": TORCH_FALLBACK}
        assert module_kernels(model, module="vision", device_type="cpu") == {}
    finally:
        unregister_family("linear_test")


def test_plan_json_and_table_name_the_kernel() -> None:
    plan = compile_plan(load_config("qwen_vl_7b", []))
    assert plan.kernels == {} and plan.to_json()["kernels"] == {}  # no linear-attention blocks
    slow = dataclasses.replace(plan, device="cuda", kernels={"llm": TORCH_FALLBACK})
    assert slow.to_json()["kernels"] == {"llm": TORCH_FALLBACK}
    caption = groups_table(slow).caption.plain  # plain text: "[gpu]" must not be read as markup
    assert "llm torch-fallback (SLOW on cuda" in caption and "pip install 'dhp[gpu]'" in caption


def test_the_plan_counts_the_devices_kernel_whatever_the_planning_host_has(monkeypatch) -> None:
    """``dhp plan conf=qwen3_5_35b_a3b --json`` (a CUDA recipe) is the same document whether the
    kernel packages import on the planning host or not, and the planner never tries to import them:
    it counts flash-linear-attention's kernel, which the plan says it needs. A CPU plan counts the
    torch fallback."""
    cfg = load_config("qwen3_5_35b_a3b", [])
    docs = []
    for present in (True, False):
        monkeypatch.setattr(linear_attn, "_importable", lambda mod, attr, p=present: p)
        docs.append(compile_plan(cfg).to_json_str())

    def refuse(mod, attr):
        raise AssertionError(f"the planner imported {mod}")

    monkeypatch.setattr(linear_attn, "_importable", refuse)
    plan = compile_plan(cfg)
    assert docs[0] == docs[1] == plan.to_json_str()
    assert plan.kernels == {"llm": FLA_CHUNK} and planned_kernel("cuda") == FLA_CHUNK
    caption = groups_table(plan).caption.plain
    assert "llm fla-chunk (needs flash-linear-attention + causal-conv1d: pip install 'dhp[gpu]')" in caption
    cpu = compile_plan(load_config("tiny_qwen3_5", []))
    assert cpu.kernels == {"llm": TORCH_FALLBACK} and planned_kernel("cpu") == TORCH_FALLBACK


def test_the_runtime_refuses_a_kernel_other_than_the_planned_one(monkeypatch) -> None:
    """At start a rank runs the planned kernel or stops with the missing packages and the fix (as a
    missing flash-attn refuses flash_attention_2), never a silent fallback."""
    present: set = set()
    monkeypatch.setattr(linear_attn, "_importable", lambda mod, attr: (mod, attr) in present)
    assert require_kernel("cpu") == TORCH_FALLBACK  # the planned kernel on CPU
    with pytest.raises(PlanError, match="flash-linear-attention and causal-conv1d do not import") as err:
        require_kernel("cuda")
    assert "pip install 'dhp[gpu]'" in str(err.value) and "fla-chunk" in str(err.value)
    present.add(linear_attn.DELTA_RULE_KERNEL)
    with pytest.raises(PlanError, match="causal-conv1d does not import"):
        require_kernel("cuda")
    present.add(linear_attn.CONV1D_KERNEL)
    assert require_kernel("cuda") == FLA_CHUNK
