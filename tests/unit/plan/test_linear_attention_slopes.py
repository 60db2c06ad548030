"""A hybrid linear-attention LLM's planned time grows linearly in the sequence length for its Gated
DeltaNet blocks and quadratically only in its full-attention quarter.

Qwen3.5-27B's LLM as its family declares it (64 blocks: 3 Gated DeltaNet blocks for every full-
attention block), beside two variants with the same widths: every block DeltaNet, and every block
full attention. The planner's LLM time per micro-batch of one sequence, on the H100 profile at one
rank (no collectives, so every term is a polynomial in S), is fitted at three sequence lengths and
checked at a fourth.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
from omegaconf import DictConfig, OmegaConf

from dhp.layout import module_layout
from dhp.plan.blocks import block_saved_elems
from dhp.plan.estimate import coefficients, module_features, module_time
from dhp.plan.memory import block_work_bytes, module_shape, saved_layers_bytes
from dhp.plan.phases import module_terms
from dhp.plan.timing import module_flops
from dhp.validation import load_config

pytestmark = pytest.mark.unit

SEQS = (4096, 8192, 16384, 32768)


@functools.cache
def _config() -> DictConfig:
    return load_config("qwen3_5_27b", [])


def _shape(variant: str, seq: int, tp: int = 1):
    """The LLM's shape at ``seq`` tokens on ``tp`` ranks: ``hybrid`` as declared, or every block
    ``linear`` / ``full`` (the declared blocks of that kind)."""
    cfg = _config()
    mod = OmegaConf.to_container(cfg.modules.llm)
    mod["parallel"].update(dp=1, fsdp=1, tp=tp, sequence_parallel=False)
    mod.update(gpus=tp, seq_len=seq, activation_checkpointing="off")
    shape = module_shape(
        "llm",
        model=cfg.model,
        module=OmegaConf.create(mod),
        layout=module_layout(OmegaConf.create(mod)),
        micro_batch=1,
    )
    # flash-linear-attention's kernel, whether or not this machine has it (the plan would name the
    # torch fallback where it is missing, and count its memory)
    shape = dataclasses.replace(shape, delta_rule_fallback=False)
    if variant == "hybrid":
        return cfg, shape
    block = next(b for b in shape.arch.blocks if b.attention.kind == variant)
    arch = dataclasses.replace(shape.arch, blocks=(block,) * shape.arch.layers)
    return cfg, dataclasses.replace(shape, arch=arch, layer=arch.layer_shape())


def _time(variant: str, seq: int) -> float:
    """The planner's LLM seconds (forward + backward) of one sequence of ``seq`` tokens."""
    cfg, shape = _shape(variant, seq)
    t = module_time(module_features(shape, shape.tokens, cfg.cluster, 1), coefficients(cfg.cluster), n_mb=1)
    return t["fwd_s"] + t["bwd_s"]


def _fit(variant: str) -> tuple[float, float, float]:
    """(c0, a, b) of T(S) = c0 + a S + b S^2 through the first three lengths; the fourth must lie on it."""
    (s1, s2, s3, s4), t = SEQS, [_time(variant, s) for s in SEQS]
    d1, d2 = (t[1] - t[0]) / (s2 - s1), (t[2] - t[1]) / (s3 - s2)
    b = (d2 - d1) / (s3 - s1)
    a = d1 - b * (s1 + s2)
    c0 = t[0] - a * s1 - b * s1 * s1
    assert c0 + a * s4 + b * s4 * s4 == pytest.approx(t[3], rel=1e-9), variant  # exactly quadratic
    return c0, a, b


def test_deltanet_time_is_linear_and_only_the_full_quarter_is_quadratic() -> None:
    _, a_lin, b_lin = _fit("linear")
    _, a_full, b_full = _fit("full")
    _, a_hyb, b_hyb = _fit("hybrid")
    # every block Gated DeltaNet: no S^2 term at all (linear slope only)
    assert b_lin == pytest.approx(0.0, abs=1e-12 * a_lin)
    assert a_lin > 0
    # 3 DeltaNet : 1 full attention: the quadratic term is exactly the full-attention quarter's
    assert b_full > 0
    assert b_hyb == pytest.approx(b_full / 4, rel=1e-6)
    # and the linear slope is the blocks' own: 3/4 of the all-DeltaNet one, 1/4 of the all-full one
    assert a_hyb == pytest.approx(0.75 * a_lin + 0.25 * a_full, rel=1e-6)
    # at 32K the full-attention quarter dominates the growth: doubling S more than doubles the time
    assert _time("hybrid", 32768) / _time("hybrid", 16384) > 2.0
    assert _time("linear", 32768) / _time("linear", 16384) < 2.0


def test_delta_rule_flops_per_token_are_constant_in_s() -> None:
    """The chunked delta rule costs the same per token at every length: per value head
    2 (C (2.5 d_k + 1.5 d_v) + 3 d_k d_v) FLOPs (``Attention.delta_rule_flops``)."""
    linear = next(b.attention for b in _shape("hybrid", 4096)[1].arch.blocks if b.attention.kind == "linear")
    assert (linear.heads, linear.kv_heads, linear.chunk_len) == (48, 16, 64)  # value / key heads, C
    per_head = 2 * (64 * (2.5 * 128 + 1.5 * 128) + 3 * 128 * 128)
    assert linear.delta_rule_flops() == 48 * per_head
    for seq in SEQS:
        _, shape = _shape("hybrid", seq)
        fl = module_flops(shape, shape.tokens)
        assert fl.linear_fwd == pytest.approx(seq * 48 * linear.delta_rule_flops(), rel=1e-12)
        assert fl.attn_span == seq / 2  # the full blocks' causal span; linear blocks have none


def test_recurrent_state_and_chunk_states_under_tp() -> None:
    """A linear block's chunk states are (S/C + 1) states of value heads/tp x d_k x d_v per sequence:
    halved by TP=2 (heads split), doubled by doubling S; they are a transient of its forward and its
    backward, not saved."""
    _, shape = _shape("hybrid", 8192)
    terms = module_terms(shape, micro_batches=1, optimizer_impl="fused")
    states = terms.fwd_work["delta_rule_states"]
    assert states == 48 * 128 * 128 * (8192 // 64 * 2 + 4)  # bf16 boundary states, fp32 last one
    assert terms.bwd_work["delta_rule_states"] == states
    _, tp2 = _shape("hybrid", 8192, tp=2)
    assert (
        module_terms(tp2, micro_batches=1, optimizer_impl="fused").fwd_work["delta_rule_states"]
        == states // 2
    )
    _, long = _shape("hybrid", 16384)
    assert module_terms(long, micro_batches=1, optimizer_impl="fused").fwd_work["delta_rule_states"] == (
        48 * 128 * 128 * (16384 // 64 * 2 + 4)
    )


def test_ac_of_linear_blocks() -> None:
    """Full AC keeps one hidden row per block, linear or not; the working set recomputed in backward
    is the largest block's (a DeltaNet block here, whose saved set is wider than the full block's)."""
    _, off = _shape("hybrid", 4096)
    h, blocks = off.arch.hidden, off.arch.blocks
    full = dataclasses.replace(off, ac=dataclasses.replace(off.ac, kind="full"))
    assert saved_layers_bytes(full) == 4096 * 64 * h * 2
    kinds = {b.attention.kind: b for b in blocks}
    lin = block_saved_elems(kinds["linear"], hidden=h, tp=1, s=1, selective=False)
    att = block_saved_elems(kinds["full"], hidden=h, tp=1, s=1, selective=False)
    assert lin > att  # the DeltaNet block keeps more per token than the full-attention one
    assert saved_layers_bytes(off) == int(4096 * (48 * lin + 16 * att) * 2)
    assert block_work_bytes(full) == int(4096 * max(lin, att) * 2)
