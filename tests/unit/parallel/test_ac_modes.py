"""Activation-checkpointing modes (full | every_n:K | selective) for both modules: same gradients as
``off``, and the recomputation is OBSERVED (ops counted during backward), so a mode that silently
checkpoints nothing, or recomputes the matmuls it should keep, fails.

Counting: a TorchDispatchMode around ``loss.backward()`` counts ``aten.mm``/``aten.addmm`` (matmuls) and
the element-wise ops that only a forward runs (``silu``/``gelu``, ``rsqrt``). Without AC, backward runs
no forward op; ``full`` replays every layer's forward (matmuls included); ``every_n:2`` replays half
the layers; ``selective`` replays the element-wise ops but takes the matmul outputs from its cache.
Tolerance: recomputation replays the same fp32 kernels on the same inputs: 1e-6 relative per tensor.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dhp.parallel.ac import AcSpec, apply_ac

sys.path.insert(0, str(Path(__file__).parents[2] / "parity"))
from parallel_harness import assert_grads_match, build_llm, build_vision, llm_batch, vision_batch

pytestmark = pytest.mark.unit
RTOL = 1e-6

_aten = torch.ops.aten
MATMUL = {_aten.mm.default, _aten.addmm.default}
FORWARD_ONLY = {_aten.silu.default, _aten.gelu.default, _aten.rsqrt.default}


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMUL:
            self.ops["matmul"] += 1
        elif func in FORWARD_ONLY:
            self.ops["fwd_elementwise"] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(model, loss_of) -> tuple[Counter, dict[str, torch.Tensor]]:
    loss = loss_of(model)
    counter = _OpCounter()
    with counter:
        loss.backward()
    return counter.ops, {k: p.grad.clone() for k, p in model.named_parameters()}


SPECS = {
    "full": AcSpec(kind="full"),
    "every_n:2": AcSpec(kind="every_n", every_n_layers=2),
    "selective": AcSpec(kind="selective"),
}


def _modes(build, loss_of, tag: str) -> dict[str, Counter]:
    off_ops, want = _backward_ops(build(), loss_of)
    assert off_ops["fwd_elementwise"] == 0 and off_ops["matmul"] > 0, off_ops
    ops = {"off": off_ops}
    for name, spec in SPECS.items():
        ops[name], got = _backward_ops(apply_ac(build(), None, spec), loss_of)
        assert_grads_match(got, want, rtol=RTOL, tag=f"{tag} ac_mode={name}")
    return ops


def _check_recompute(ops: dict[str, Counter], layers: int) -> None:
    off, full, half, sel = ops["off"], ops["full"], ops["every_n:2"], ops["selective"]
    # full: every layer's forward replayed, matmuls included
    assert full["matmul"] > off["matmul"] and full["fwd_elementwise"] > 0, ops
    # every_n:2: half of the layers replayed: strictly between off and full
    assert off["matmul"] < half["matmul"] < full["matmul"], ops
    assert 0 < half["fwd_elementwise"] < full["fwd_elementwise"], ops
    # selective: the element-wise ops of every layer replayed, no matmul recomputed
    assert sel["matmul"] == off["matmul"], ops
    assert sel["fwd_elementwise"] == full["fwd_elementwise"] >= layers, ops


def test_ac_mode_llm_recomputes_and_keeps_grads() -> None:
    b = llm_batch(seed=3)
    ops = _modes(build_llm, lambda m: m(**b), "llm")
    _check_recompute(ops, layers=2)


def test_ac_mode_vision_recomputes_and_keeps_grads() -> None:
    b = vision_batch(seed=4, grids=[(1, 8, 8), (1, 4, 8)])
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(5))
    ops = _modes(build_vision, lambda m: (m(**b) * w).sum(), "vision")
    _check_recompute(ops, layers=4)
