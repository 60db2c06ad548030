"""Activation checkpointing changes memory, not math: same loss and every gradient with and without,
for the LLM and the vision module, with parameter FQNs unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dhp.errors import PlanError
from dhp.parallel.ac import AcSpec, apply_ac

sys.path.insert(0, str(Path(__file__).parents[2] / "parity"))
from parallel_harness import assert_grads_match, build_llm, build_vision, llm_batch, vision_batch

pytestmark = pytest.mark.unit

# recomputation replays the same fp32 kernels on the same inputs: bitwise-equal in practice; the
# stated bound is 1e-6 relative per tensor (norm sense).
RTOL = 1e-6


def _grads(model, loss) -> dict[str, torch.Tensor]:
    loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def test_llm_ac_same_grads() -> None:
    b = llm_batch(seed=3)
    ref = build_llm()
    want = _grads(ref, ref(**b))
    ac = apply_ac(build_llm(), None, AcSpec())
    assert all(layer.gradient_checkpointing for layer in ac.language_model.layers)
    assert_grads_match(_grads(ac, ac(**b)), want, rtol=RTOL, tag="llm ac")


def test_vision_ac_same_grads() -> None:
    b = vision_batch(seed=4, grids=[(1, 8, 8), (1, 4, 8)])
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(5))
    ref = build_vision()
    want = _grads(ref, (ref(**b) * w).sum())
    ac = apply_ac(build_vision(), None, AcSpec())
    assert all(block.gradient_checkpointing for block in ac.visual.blocks)
    assert_grads_match(_grads(ac, (ac(**b) * w).sum()), want, rtol=RTOL, tag="vision ac")


def test_ac_without_a_transformers_model_is_refused() -> None:
    with pytest.raises(PlanError, match="activation_checkpointing"):
        apply_ac(torch.nn.Linear(2, 2), None, AcSpec())
