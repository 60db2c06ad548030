"""A hybrid linear-attention LLM's planned time grows linearly in the sequence length for its Gated
DeltaNet blocks and quadratically only in its full-attention quarter.

A Qwen3.5-like LLM is declared as data only (a throwaway family registered in this test: 64 blocks,
3 Gated DeltaNet blocks for every full-attention block, the 27B's published widths), beside two
variants with the same widths: every block linear, and every block full attention. The planner's LLM
time per micro-batch of one sequence, on the H100 profile at TP=1 (no collectives, so every term is
a polynomial in S), is fitted at three sequence lengths and checked at a fourth.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
from omegaconf import DictConfig, OmegaConf

from dhp.config import load_config
from dhp.models.arch import Architecture, Attention, Block, Mlp, ModuleArch, ParamCount
from dhp.models.qwen2_5_vl.arch import ARCH as QWEN25
from dhp.models.registry import get_family, register_family, unregister_family
from dhp.plan.estimate import coefficients, module_features, module_time
from dhp.plan.memory import module_shape
from dhp.plan.phases import module_terms
from dhp.plan.timing import module_flops

pytestmark = pytest.mark.unit

H, LAYERS, MLP, VOCAB = 5120, 64, 17408, 248320
FULL = Attention(kind="full", heads=24, kv_heads=4, head_dim=256, causal=True)
LINEAR = Attention(
    kind="linear",
    heads=48,
    kv_heads=16,
    head_dim=128,
    value_dim=128,
    state=128 * 128,
    chunk=64,
    conv_kernel=4,
)
SEQS = (4096, 8192, 16384, 32768)


def _llm(pattern: str) -> ModuleArch:
    """``pattern`` per block: ``l`` Gated DeltaNet, ``f`` full attention (repeated to 64 blocks)."""
    mlp = Mlp(kind="dense", intermediate=MLP)
    kinds = (pattern * LAYERS)[:LAYERS]
    blocks = tuple(Block(LINEAR if k == "l" else FULL, mlp) for k in kinds)
    per_block = [b.attention.proj_macs(H) + b.mlp.macs(H) for b in blocks]
    return ModuleArch(
        hidden=H,
        blocks=blocks,
        params=ParamCount(tp_sharded=int(sum(per_block)) + 2 * VOCAB * H, replicated=LAYERS * 2 * H + H),
        block_params=ParamCount(tp_sharded=int(max(per_block)), replicated=2 * H),
        largest_param=VOCAB * H,
        inputs=("image_embeds",),
        head_macs=float(H * VOCAB),
        vocab=VOCAB,
    )


class HybridArch:
    """The tiny Qwen2.5-VL's encoder and validation; an LLM declared by ``pattern``."""

    capabilities = QWEN25.capabilities

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern

    def validate(self, model: DictConfig, issues) -> None:
        QWEN25.validate(model, issues)

    def module_axes(self, name: str, model: DictConfig):
        return QWEN25.module_axes(name, model)

    def architecture(self, model: DictConfig) -> Architecture:
        real = QWEN25.architecture(model)
        return dataclasses.replace(real, modules={**real.modules, "llm": _llm(self.pattern)})


@pytest.fixture(scope="module")
def families():
    names = {"hybrid": "lllf", "linear": "l", "full": "f"}
    for key, pattern in names.items():
        register_family(f"throwaway_{key}", lambda: get_family("qwen2_5_vl"), arch=HybridArch(pattern))
    yield {key: f"throwaway_{key}" for key in names}
    for key in names:
        unregister_family(f"throwaway_{key}")


@functools.cache
def _config(family: str) -> DictConfig:
    return load_config("tiny_vlm", [f"model.family={family}", "cluster=h100_8x", "model.dtype=bfloat16"])


def _shape(family: str, seq: int):
    cfg = _config(family)
    mod = OmegaConf.to_container(cfg.modules.llm)
    mod["parallel"].update(tp=1, sequence_parallel=False)
    mod.update(gpus=1, seq_len=seq, activation_checkpointing="off")
    return cfg, module_shape("llm", model=cfg.model, module=OmegaConf.create(mod), micro_batch=1)


def _time(family: str, seq: int) -> float:
    """The planner's LLM seconds (forward + backward) of one sequence of ``seq`` tokens."""
    cfg, shape = _shape(family, seq)
    t = module_time(module_features(shape, shape.tokens, cfg.cluster, 1), coefficients(cfg.cluster), n_mb=1)
    return t["fwd_s"] + t["bwd_s"]


def _fit(family: str) -> tuple[float, float, float]:
    """(c0, a, b) of T(S) = c0 + a S + b S^2 through the first three lengths; the fourth must lie on it."""
    (s1, s2, s3, s4), t = SEQS, [_time(family, s) for s in SEQS]
    d1, d2 = (t[1] - t[0]) / (s2 - s1), (t[2] - t[1]) / (s3 - s2)
    b = (d2 - d1) / (s3 - s1)
    a = d1 - b * (s1 + s2)
    c0 = t[0] - a * s1 - b * s1 * s1
    assert c0 + a * s4 + b * s4 * s4 == pytest.approx(t[3], rel=1e-9), family  # exactly quadratic
    return c0, a, b


def test_deltanet_time_is_linear_and_only_the_full_quarter_is_quadratic(families) -> None:
    _, a_lin, b_lin = _fit(families["linear"])
    _, a_full, b_full = _fit(families["full"])
    _, a_hyb, b_hyb = _fit(families["hybrid"])
    # every block Gated DeltaNet: no S^2 term at all (linear slope only)
    assert b_lin == pytest.approx(0.0, abs=1e-12 * a_lin)
    assert a_lin > 0
    # 3 DeltaNet : 1 full attention: the quadratic term is exactly the full-attention quarter's
    assert b_full > 0
    assert b_hyb == pytest.approx(b_full / 4, rel=1e-6)
    # and the linear slope is the blocks' own: 3/4 of the all-DeltaNet one, 1/4 of the all-full one
    assert a_hyb == pytest.approx(0.75 * a_lin + 0.25 * a_full, rel=1e-6)
    # at 32K the full-attention quarter dominates the growth: doubling S more than doubles the time
    assert _time(families["hybrid"], 32768) / _time(families["hybrid"], 16384) > 2.0
    assert _time(families["linear"], 32768) / _time(families["linear"], 16384) < 2.0


def test_delta_rule_flops_per_token_are_constant_in_s(families) -> None:
    """The chunked delta rule costs the same per token at every length: per value head
    2 (C (2.5 d_k + 1.5 d_v) + 3 d_k d_v) FLOPs (``Attention.delta_rule_flops``)."""
    per_head = 2 * (64 * (2.5 * 128 + 1.5 * 128) + 3 * 128 * 128)
    assert LINEAR.delta_rule_flops() == 48 * per_head
    for seq in SEQS:
        _, shape = _shape(families["hybrid"], seq)
        fl = module_flops(shape, shape.tokens)
        assert fl.linear_fwd == pytest.approx(seq * 48 * LINEAR.delta_rule_flops(), rel=1e-12)
        assert fl.attn_span == seq / 2  # the full blocks' causal span; linear blocks have none


def test_recurrent_state_and_chunk_states_under_tp(families) -> None:
    """A linear block's chunk states are (S/C + 1) states of value heads/tp x d_k x d_v per sequence:
    halved by TP=2 (heads split), doubled by doubling S; they are a transient of its forward and its
    backward, not saved."""
    cfg, shape = _shape(families["hybrid"], 8192)
    terms = module_terms(shape, micro_batches=1, optimizer_impl="fused")
    states = terms.fwd_work["delta_rule_states"]
    assert states == 48 * 128 * 128 * (8192 // 64 * 2 + 4)  # bf16 boundary states, fp32 last one
    assert terms.bwd_work["delta_rule_states"] == states
    mod = OmegaConf.to_container(cfg.modules.llm)
    mod["parallel"].update(tp=2, sequence_parallel=False)
    mod.update(gpus=2, seq_len=8192, activation_checkpointing="off")
    tp2 = module_shape("llm", model=cfg.model, module=OmegaConf.create(mod), micro_batch=1)
    assert (
        module_terms(tp2, micro_batches=1, optimizer_impl="fused").fwd_work["delta_rule_states"]
        == states // 2
    )


def test_ac_of_linear_blocks(families) -> None:
    """Full AC keeps one hidden row per block, linear or not; the working set recomputed in backward
    is the largest block's (a DeltaNet block here, whose saved set is wider than the full block's)."""
    from dhp.plan.blocks import block_saved_elems
    from dhp.plan.memory import block_work_bytes, saved_layers_bytes

    _, off = _shape(families["hybrid"], 4096)
    full = dataclasses.replace(off, ac=dataclasses.replace(off.ac, kind="full"))
    assert saved_layers_bytes(full) == 4096 * LAYERS * H * 2
    lin = block_saved_elems(Block(LINEAR, off.arch.blocks[0].mlp), hidden=H, tp=1, s=1, selective=False)
    att = block_saved_elems(Block(FULL, off.arch.blocks[0].mlp), hidden=H, tp=1, s=1, selective=False)
    assert saved_layers_bytes(off) == int(4096 * (48 * lin + 16 * att) * 2)
    assert block_work_bytes(full) == int(4096 * max(lin, att) * 2)
