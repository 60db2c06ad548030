"""Each memory, FLOP and communication term of the planner on a 2-layer toy whose bytes are
counted by hand in the comments (fp32, 4 bytes per element)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from dhp.config.schema import ModuleConfig
from dhp.layout import module_layout
from dhp.plan.memory import default_loss_chunk, module_shape
from dhp.plan.phases import gpu_timeline, module_terms, reserve_bytes
from dhp.plan.timing import (
    Link,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    grad_sync_s,
    module_comm,
    module_flops,
    optimizer_s,
)

pytestmark = pytest.mark.unit

# LLM: h=8, m=16, 2 heads of 4 (kv=4 with 1 KV head), 2 layers, vocab 32.
MODEL = OmegaConf.create(
    {
        "family": "qwen2_5_vl",
        "dtype": "float32",
        "attn_implementation": "sdpa",
        "vision": {
            "depth": 2,
            "hidden_size": 8,
            "num_heads": 2,
            "intermediate_size": 16,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "extra": {"window_size": 28, "fullatt_block_indexes": [1]},  # 2x2 patches = 4 per window
        },
        "llm": {
            "hidden_size": 8,
            "num_layers": 2,
            "num_heads": 2,
            "num_kv_heads": 1,
            "intermediate_size": 16,
            "vocab_size": 32,
            "tie_word_embeddings": False,
        },
    }
)


def _shape(name: str, *, seq: int = 4, mb: int = 1, ac: str = "off", chunk: int = 0, mp: str = "fp32", **par):
    degrees = {"dp": 1, "fsdp": 1, "sp": 1, "tp": 1, "zero": 0, "sequence_parallel": False} | par
    module = OmegaConf.merge(
        OmegaConf.structured(ModuleConfig),
        {
            "parallel": degrees,
            "seq_len": seq,
            "activation_checkpointing": ac,
            "loss_chunk_tokens": chunk,
            "freeze": False,
            "mixed_precision": mp,
        },
    )
    return module_shape(
        name, model=MODEL, module=module, layout=module_layout(module), micro_batch=mb, image_patches=seq
    )


# LLM parameters: layer = q (64+8) + k,v 2*(32+4) + o 64 + MLP 3*128 = 592 sharded, 2 norms 16;
# 2 layers + embed/lm_head 2*32*8 = 512 -> 1696 sharded + 40 replicated (final norm 8) = 1736.
P_LLM = 1736


def test_model_states_bytes() -> None:
    t = module_terms(_shape("llm"), micro_batches=1, optimizer_impl="for_loop")
    assert (t.params, t.grads, t.optimizer) == (4 * P_LLM, 4 * P_LLM, 8 * P_LLM)
    tp2 = module_terms(_shape("llm", tp=2), micro_batches=1, optimizer_impl="for_loop")
    assert tp2.params == 4 * (1696 // 2 + 40)
    z1 = module_terms(_shape("llm", dp=2, zero=1), micro_batches=1, optimizer_impl="for_loop")
    assert z1.optimizer == 8 * P_LLM // 2


def test_master_weights_states_activations_and_compute_copies() -> None:
    # bf16_master_fp32: fp32 parameters, gradients and AdamW states (4 + 4 + 8 B per parameter),
    # bf16 compute (2 B per activation element, the hand-off rows included)
    mp = "bf16_master_fp32"
    t = module_terms(_shape("llm", mp=mp), micro_batches=1, optimizer_impl="fused")
    assert (t.params, t.grads, t.optimizer) == (4 * P_LLM, 4 * P_LLM, 8 * P_LLM)
    assert t.saved["layers"] == 4 * 2 * 140 * 2 and t.handoff == 4 * 8 * 2
    # fsdp=1, the unit cast: each block's bf16 copy (608 = 592 + 2 norms of 8) and the root's
    # (1736 - 2 * 608 = 520: embedding, lm_head, final norm) are saved for backward, 2 B each
    assert t.saved["compute_weights"] == (2 * 608 + 520) * 2
    assert "compute_block" not in t.fwd_work
    # AC full: a block's copy is dropped at its end and cast again in its recompute
    full = module_terms(_shape("llm", mp=mp, ac="full"), micro_batches=1, optimizer_impl="fused")
    assert full.saved["compute_weights"] == 520 * 2
    assert full.fwd_work["compute_block"] == full.bwd_work["compute_block"] == 608 * 2
    # every_n:2 on 2 layers: block 1 keeps its copy
    every = module_terms(_shape("llm", mp=mp, ac="every_n:2"), micro_batches=1, optimizer_impl="fused")
    assert every.saved["compute_weights"] == (520 + 608) * 2
    # FSDP: its all-gather is the cast (bf16 gathered blocks), gradients reduce-scattered in fp32
    f = module_terms(_shape("llm", mp=mp, fsdp=2), micro_batches=1, optimizer_impl="fused")
    assert "compute_weights" not in f.saved
    assert f.fwd_work["fsdp_gather"] == (2 * 608 + 520) * 2 and f.bwd_work["fsdp_reduce_scatter"] == 608 * 4
    assert (f.params, f.grads, f.optimizer) == (4 * P_LLM // 2, 4 * P_LLM // 2, 8 * P_LLM // 2)
    # bf16 stores bf16 (2 + 2 + 4) and casts nothing; fp32 computes in fp32
    b = module_terms(_shape("llm", mp="bf16"), micro_batches=1, optimizer_impl="fused")
    assert (b.params, b.grads, b.optimizer) == (
        2 * P_LLM,
        2 * P_LLM,
        4 * P_LLM,
    ) and "compute_weights" not in b.saved
    assert b.saved["layers"] == t.saved["layers"] and b.handoff == t.handoff
    fp32 = module_terms(_shape("llm"), micro_batches=1, optimizer_impl="fused")
    assert fp32.handoff == 2 * t.handoff and "compute_weights" not in fp32.saved


def test_saved_activations_per_ac_mode() -> None:
    # per token and layer: 4h + (4h + 3kv) + 4m = 32 + 44 + 64 = 140 elements; 4 tokens, 2 layers
    off = module_terms(_shape("llm"), micro_batches=1, optimizer_impl="for_loop").saved
    assert off["layers"] == 4 * 2 * 140 * 4
    assert off["final_norm"] == 4 * 2 * 8 * 4
    full = module_terms(_shape("llm", ac="full"), micro_batches=1, optimizer_impl="for_loop")
    assert full.saved["layers"] == 4 * 2 * 8 * 4  # each block's input
    assert full.bwd_work["recompute_block"] == 4 * 140 * 4
    # selective: 2h + (2h + 2kv) + 2m = 16 + 24 + 32 = 72
    assert (
        module_terms(_shape("llm", ac="selective"), micro_batches=1, optimizer_impl="for_loop").saved[
            "layers"
        ]
        == 4 * 2 * 72 * 4
    )
    # every_n:2 on 2 layers: block 0 checkpointed (input h), block 1 keeps 140
    assert (
        module_terms(_shape("llm", ac="every_n:2"), micro_batches=1, optimizer_impl="for_loop").saved[
            "layers"
        ]
        == 4 * (8 + 140) * 4
    )


def test_sequence_parallel_cuts_the_norm_terms_by_tp() -> None:
    # tp=2: 4h/s + (4h+3kv)/2 + 4m/2; s=1 -> 32+22+32 = 86, s=2 -> 16+22+32 = 70
    plain = module_terms(_shape("llm", tp=2), micro_batches=1, optimizer_impl="for_loop")
    sp = module_terms(_shape("llm", tp=2, sequence_parallel=True), micro_batches=1, optimizer_impl="for_loop")
    assert plain.saved["layers"] == 4 * 2 * 86 * 4 and sp.saved["layers"] == 4 * 2 * 70 * 4
    assert sp.saved["final_norm"] == plain.saved["final_norm"] // 2
    assert sp.handoff == plain.handoff // 2  # each TP rank receives its sequence shard


def test_loss_unchunked_and_chunked() -> None:
    assert default_loss_chunk(32, 1, 4) == 4  # never longer than the micro-batch
    assert default_loss_chunk(152064, 8, 10**6) == 2048  # 2048 * 19008 * 4 B <= 256 MiB
    whole = module_terms(_shape("llm"), micro_batches=1, optimizer_impl="for_loop")
    # the loss recomputes its logits in backward whatever the chunk: it saves the 4 tokens' hidden
    # rows (8 fp32), targets (int64) and log-sum-exp (fp32) only
    assert whole.saved["loss_inputs"] == 4 * (8 * 4 + 8 + 4)
    assert whole.fwd_work["loss_chunk"] == 4 * 32 * (4 + 4)  # one chunk = the 4 tokens
    assert whole.bwd_work["lm_head_grad_fp32"] == 32 * 8 * 4  # fp32 accumulator of lm_head's grad
    chunked = module_terms(_shape("llm", chunk=2), micro_batches=1, optimizer_impl="for_loop")
    assert chunked.saved["loss_inputs"] == whole.saved["loss_inputs"]
    assert chunked.fwd_work["loss_chunk"] == 2 * 32 * (4 + 4)
    assert chunked.bwd_work["loss_chunk"] == 2 * 32 * (4 + 8)


def test_buffers_grad_norm_optimizer_fsdp() -> None:
    t = module_terms(_shape("llm", dp=2), micro_batches=1, optimizer_impl="for_loop")
    assert t.sync == 4 * P_LLM  # the flat all-reduce copy of every grad
    assert t.norm == 2 * 8 * 256  # fp64 square of the largest param (lm_head 32x8) and its sum
    # AdamW's temporaries by implementation: for_loop sqrt(v), sqrt(v)/bc2 and the previous
    # parameter's denom, of the largest parameter (256 elements, fp32); foreach sqrt(v) of every
    # parameter; fused none
    assert t.optim == 3 * 256 * 4
    assert module_terms(_shape("llm"), micro_batches=1, optimizer_impl="foreach").optim == P_LLM * 4
    assert module_terms(_shape("llm"), micro_batches=1, optimizer_impl="fused").optim == 0
    f = module_terms(_shape("llm", fsdp=2), micro_batches=1, optimizer_impl="for_loop")
    # 2 gathered blocks (608 each) + the root unit (1736 - 2*608 = 520), fp32 (fp32 policy)
    assert f.fwd_work["fsdp_gather"] == (2 * 608 + 520) * 4
    assert f.bwd_work["fsdp_reduce_scatter"] == 608 * 4


def test_phases_grads_only_after_backward_and_two_encoder_micro_batches() -> None:
    one = module_terms(_shape("llm"), micro_batches=1, optimizer_impl="for_loop")
    assert "grads" not in one.live("llm_fwd") and one.live("llm_bwd")["grads"] == 4 * P_LLM
    assert (
        module_terms(_shape("llm"), micro_batches=2, optimizer_impl="for_loop").live("llm_fwd")["grads"]
        == 4 * P_LLM
    )
    vis = module_terms(_shape("vision", seq=16), micro_batches=2, optimizer_impl="for_loop")
    assert vis.live("llm_bwd")["activations"] == 2 * vis.saved_total
    assert "activations" not in vis.live("optimizer")
    line = gpu_timeline([vis, one])
    for phase in vis.phases:
        assert line.by_phase[phase] == sum(vis.live(phase).values()) + sum(one.live(phase).values())
    assert line.peak == max(line.by_phase.values())
    assert reserve_bytes(80 << 30, processes=2) == 2 * (1 << 30) + int(0.05 * (80 << 30))


def test_flops_formulas() -> None:
    s = _shape("llm", ac="full")
    fl = module_flops(s, 4)
    n = 2 * (2 * 64 + 2 * 8 * 4 + 3 * 8 * 16) + 8 * 32  # blocks + lm_head = 1408
    assert fl.matmul_fwd == 2 * 4 * n
    assert fl.attn_fwd == 4 * 4 * (4 / 2) * 8 * 2  # causal: span S/2, 2 layers
    assert fl.recompute_matmul == 2 * 4 * (n - 8 * 32)  # full AC recomputes the blocks, not lm_head
    assert fl.bwd == 2 * fl.matmul_fwd + 2.5 * fl.attn_fwd + fl.recompute_matmul + fl.recompute_attn
    v = module_flops(_shape("vision", seq=16), 16)
    # vision: 1 full block (span 16) + 1 window block (span 4): 4 * 16 * span * 8 each
    assert v.attn_fwd == 4 * 16 * 16 * 8 + 4 * 16 * 4 * 8
    assert module_flops(_shape("vision", seq=16, sp=2), 8).attn_fwd == v.attn_fwd / 2


def test_comm_formulas() -> None:
    bw, lat = 1e9, 1e-5
    assert all_reduce_s(1e6, 4, bw, lat) == pytest.approx(2 * 3 / 4 * 1e6 / bw + 2 * 3 * lat)
    assert all_gather_s(1e6, 4, bw, lat) == pytest.approx(3 / 4 * 1e6 / bw + 3 * lat)
    assert all_to_all_s(1e6, 4, bw, lat) == pytest.approx(3 / 4 * 1e6 / bw + 3 * lat)
    link = Link(intra=bw, inter=bw / 10, lat=lat, gpn=4)
    tp = module_comm(_shape("llm", tp=2), 4, link)
    one_ar = all_reduce_s(4 * 8 * 4, 2, bw, lat)
    # 2 blocks: forward the 2 outputs' all-reduces a block; backward one per column-parallel input's
    # grad (q, k, v, gate, up: 5 a block)
    assert tp["fwd"] == pytest.approx(2 * 2 * one_ar) and tp["bwd"] == pytest.approx(2 * 5 * one_ar)
    sp = module_comm(_shape("vision", seq=16, sp=2), 8, link)
    assert sp["fwd"] == pytest.approx(
        4 * 1 * all_to_all_s(8 * 8 * 4, 2, bw, lat)
    )  # q, k, v, out; 1 full block
    s = _shape("llm", dp=2)
    assert grad_sync_s(s, link, world=2) == pytest.approx(all_reduce_s(4 * P_LLM, 2, bw, lat))
    hbm = OmegaConf.create({"hbm_gbps": 1.0, "memory_efficiency": 1.0})
    # AdamW reads p, g, m, v and writes p, m, v; the norm reads and the clip reads + writes the grads
    assert optimizer_s(_shape("llm"), hbm) == pytest.approx(P_LLM * (2 * 4 + 4 + 2 * 8 + 3 * 4) / 1e9)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_adamw_states_bytes_equal_the_planners(dtype: str) -> None:
    """torch's AdamW (what build_optimizer returns without ZeRO-1) allocates what precision() says."""
    import torch

    from dhp.plan.memory import precision

    p = torch.nn.Parameter(torch.zeros(64, 8, dtype=getattr(torch, dtype)))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones_like(p)
    opt.step()
    state = [t for t in opt.state[p].values() if t.dim() > 0]
    want = precision({"bfloat16": "bf16", "float32": "fp32"}[dtype])
    assert sum(t.numel() * t.element_size() for t in state) == want.optimizer * p.numel()
    assert p.grad.element_size() == want.grad and p.element_size() == want.param


def test_grads_and_activations_coexist_as_the_driver_orders_them() -> None:
    # LLM, one micro-batch: forward holds S; backward writes lm_head's grad (32x8 fp32 = 1024 B, the
    # largest tensor) while S is alive, then frees S as it writes the rest: max(S + G1, G)
    one = module_terms(_shape("llm", seq=64), micro_batches=1, optimizer_impl="for_loop")
    s, g = one.saved_total, 4 * P_LLM
    assert one.first_grad == 32 * 8 * 4
    assert one.grads_and_activations("llm_fwd") == (0, s)
    assert sum(one.grads_and_activations("llm_bwd")) == max(s + 1024, g)
    assert one.grads_and_activations("optimizer") == (g, 0)
    assert one.grads_and_activations("vision_fwd") == (0, 0)  # before its backward: no grads yet
    # encoder, two micro-batches: fwd 0, fwd 1 (2S, no grads), bwd 0 (S + G), bwd 1
    two = module_terms(_shape("vision", seq=16), micro_batches=2, optimizer_impl="for_loop")
    sv, gv = two.saved_total, two.grads
    assert two.grads_and_activations("vision_fwd") == (0, 2 * sv)
    assert sum(two.grads_and_activations("llm_fwd")) == max(2 * sv, gv + sv)
    # three or more: fwd 2 runs after bwd 0, so G + 2S coexist
    three = module_terms(_shape("vision", seq=16), micro_batches=3, optimizer_impl="for_loop")
    assert three.grads_and_activations("vision_fwd") == (gv, 2 * sv)
    # the accounted peak: params + optimizer + the largest (grads + activations), no transients
    assert two.accounted_peak() == two.params + two.optimizer + max(2 * sv, gv + sv)


def test_call_overhead_counts() -> None:
    from dhp.plan.overheads import phase_counts

    # LLM, tp=2 with sequence parallelism, 4 tokens in loss chunks of 2. Forward: per block 2 RS +
    # 2 AG (8 for 2 blocks), the embedding's all-reduce, 2 loss all-reduces per chunk (2 chunks: 4).
    # Backward: per block the 5 column-parallel inputs' grad all-reduces (q, k, v, gate, up, as
    # torch's TP styles issue them) and the 2 outputs' grad all-gathers: 14, + the loss's input grad
    # and the merged embeddings' grad all-gather (SP).
    # Blocks L+1 = 3 forward, 2 (L+1) = 6 backward, every one through DTensor
    c = phase_counts(_shape("llm", tp=2, sequence_parallel=True, chunk=2), 4.0)
    fwd = {"blocks": 3, "dtensor_blocks": 3, "fsdp_blocks": 0, "attention_calls": 2, "collectives": 13}
    assert c["fwd"] == fwd
    bwd = {"blocks": 6, "dtensor_blocks": 6, "fsdp_blocks": 0, "attention_calls": 2, "collectives": 16}
    assert c["bwd"] == bwd
    # the step: (2 blocks x 12 + 3) parameter tensors, x2 as DTensors; the grad-norm all-reduce
    assert c["step"] == {"tensors": 54, "collectives": 1}
    # without SP the backward has no all-gathers; full AC replays the forward's 2 all-reduces a block
    n = phase_counts(_shape("llm", tp=2, chunk=2, ac="full"), 4.0)
    assert n["bwd"]["collectives"] == 2 * 5 + 2 * 2 + 1
    # encoder, Ulysses sp=2 on 8 patches of one image (4 per rank), full AC: window block (4-patch
    # windows) 1 call, the full block attends the 1 image; 2 all-to-alls per full block (fused qkv,
    # out) and 1 rotary-table gather per forward; backward: their 2 grads + the recomputed forward's 3
    v = phase_counts(_shape("vision", seq=8, sp=2, ac="full"), 4.0)
    assert v["fwd"] == {
        "blocks": 3,
        "dtensor_blocks": 0,
        "fsdp_blocks": 0,
        "attention_calls": 2,
        "collectives": 3,
    }
    assert v["bwd"] == {
        "blocks": 8,
        "dtensor_blocks": 0,
        "fsdp_blocks": 0,
        "attention_calls": 4,
        "collectives": 5,
    }
    # vision: 2 x 12 + 6 tensors; grad norm + the SP gradient all-reduce
    assert v["step"] == {"tensors": 30, "collectives": 2}
    # FSDP2 over 2 with full AC: each of the L+1 = 3 sharded units runs its hooks once a forward and
    # once a backward, plus its forward hooks again for each recomputed block (2). Collectives: an
    # all-gather a unit forward; backward an all-gather and a reduce-scatter a unit (the recompute
    # runs inside the unit's backward, on the weights already gathered)
    f = phase_counts(_shape("llm", fsdp=2, ac="full"), 4.0)
    assert (f["fwd"]["fsdp_blocks"], f["bwd"]["fsdp_blocks"]) == (3, 3 + 2)
    assert (f["fwd"]["collectives"], f["bwd"]["collectives"]) == (3, 6)
    assert f["fwd"]["dtensor_blocks"] == f["bwd"]["dtensor_blocks"] == 0
    z = phase_counts(_shape("llm", dp=4, zero=1), 4.0)["step"]
    assert z["collectives"] == 1 + 1 + 4  # norm, DP all-reduce, one broadcast per ZeRO-1 owner
    # ZeRO-1 over 4: AdamW's 0.7 of the per-tensor ops on a quarter of the 27 tensors, norm/clip on all
    assert z["tensors"] == pytest.approx(27 * (0.3 + 0.7 / 4))


def test_sp_ranks_hold_whole_windows() -> None:
    from dhp.plan.memory import sp_rank_tokens
    from dhp.plan.params import architecture

    v = architecture(MODEL).modules["vision"]  # windows of (28 / 14)^2 = 4 patches
    assert v.sp_unit == 4
    assert sp_rank_tokens(v, 16, 2, 16) == 8  # 4 windows over 2 ranks: 2 each
    assert sp_rank_tokens(v, 16, 8, 16) == 4  # 4 windows over 8 ranks: the fullest holds one window
    assert sp_rank_tokens(v, 12, 2, 12) == 8  # 3 windows over 2 ranks: ceil(3/2) = 2 windows
    assert sp_rank_tokens(v, 16, 1, 16) == 16


@pytest.fixture(scope="module")
def fake_world():
    """A 2-rank fake process group in this process (collectives dispatch and do nothing): enough to
    build, parallelize and step a module and count what it allocates on rank 0."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _local_bytes(tensors) -> int:
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


@pytest.mark.parametrize("policy", ["fp32", "bf16_master_fp32", "bf16"])
@pytest.mark.parametrize("degrees", [{"tp": 2}, {"fsdp": 2}, {"dp": 2}], ids=["tp2", "fsdp2", "dp2"])
def test_model_states_equal_what_a_parallelized_module_allocates(
    fake_world, policy: str, degrees: dict
) -> None:
    """The tiny Qwen2.5-VL LLM built as the worker builds it (fp32 weights stored in the policy's
    parameter dtype), parallelized, one forward + backward + AdamW step: its parameters, gradients
    and AdamW states (local shards, in the dtypes the policy names) are exactly the planner's bytes."""
    import torch

    from dhp.config.schema import TrainConfig
    from dhp.layout import ParallelLayout
    from dhp.models import get_family
    from dhp.models.entries import model_entry
    from dhp.models.testing import tiny_vl_batch
    from dhp.parallel import build_mesh, build_optimizer, cast_parameters_, parallelize, precision_of

    entry = model_entry("tiny")
    family = get_family(entry.family)
    cfg = family.hf_config(entry)
    pol = precision_of(policy)
    module = cast_parameters_(
        family.build_module("llm", cfg, device="cpu", dtype=torch.float32), pol.param_dtype
    )
    layout = ParallelLayout(**degrees)
    mesh = build_mesh(layout, "cpu")
    parallelize("llm", module, mesh, layout, activation_checkpointing="off", mixed_precision=policy)
    batch = tiny_vl_batch(cfg, images=[[]], text_lens=[16], seed=0)  # text only: no hand-off edges
    out = module(**{k: batch[k] for k in ("input_ids", "attention_mask", "labels", "mm_token_type_ids")},
                 image_grid_thw=None, sample_ids=batch["sample_ids"])  # fmt: skip
    (out.loss_sum / out.num_tokens).backward()
    params = list(module.parameters())
    got = {"params": _local_bytes(params), "grads": _local_bytes([p.grad for p in params])}
    optimizer = build_optimizer(module, mesh, layout, train=TrainConfig())
    optimizer.step()
    states = [t for st in optimizer.state.values() for t in st.values() if t.dim() > 0]
    got["optimizer"] = _local_bytes(states)
    assert {p.dtype for p in params} | {t.dtype for t in states} == {pol.param_dtype}
    assert {p.grad.dtype for p in params} == {pol.param_dtype}

    planned = OmegaConf.merge(
        OmegaConf.structured(ModuleConfig),
        {"parallel": degrees, "seq_len": 16, "mixed_precision": policy, "gpus": 2},
    )
    shape = module_shape(
        "llm", model=OmegaConf.structured(entry), module=planned, layout=module_layout(planned), micro_batch=1
    )
    t = module_terms(shape, micro_batches=1, optimizer_impl="fused")
    assert got == {"params": t.params, "grads": t.grads, "optimizer": t.optimizer}
    assert shape.precision.act == torch.tensor([], dtype=pol.compute_dtype).element_size()
