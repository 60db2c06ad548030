"""Sequence packing: a packed micro-batch against the same samples unpacked, for every family that packs.

dhp.models' own LLMModule. Samples of mixed lengths (multi-image, text-only) are packed by
``dhp.data.packing.pack`` into two rows. Every sample's M-RoPE positions restart in the packed row,
and attention never crosses samples: otherwise the numbers differ. The packed label count equals the
unpacked one (same normaliser).

Qwen2.5-VL: the reference runs every sample alone (its own batch, its own ``get_rope_index``) and sums
the loss sums; one process (SDPA, and a "flash" attention implementation that runs SDPA per
``cu_seq_lens`` sequence on CPU, proving the varlen kwargs the GPU path hands to flash attention) and
TP 2 + SP.

Qwen3-VL (DeepStack), Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet): the reference is the same
samples right-padded into one unpacked batch (in the packed row-major order, so the vision rows line
up), one call: the MoE router's load-balancing loss is a term over the batch, compared too. The rows
are longer than a delta-rule chunk (64 tokens) and samples start inside chunks and run across chunk
boundaries, so a DeltaNet layer that carried its state or its conv from one sample into the next
would show. Cases: one process for each (Qwen3.5 in the fast tier), Qwen3.5 under full activation
checkpointing (the recompute splits the samples again), under context parallelism 2, and under TP 2
with sequence parallelism.

Tolerance (fp32, CPU): loss within 1e-5 relative; every gradient within 1e-5 relative for Qwen2.5-VL,
1e-4 for the Qwen3 families (norm sense; measured values at ``QWEN3_GRAD_RTOL``); masked-out keys and
reordered sums only move the last bits.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_harness import assert_grads_match, assert_rel_close, full_grads, spawn
from torch.distributed.device_mesh import init_device_mesh
from transformers import AttentionInterface

from dhp.data.batch import Sample
from dhp.data.packing import is_packed, pack, unpack
from dhp.ops.packed import segments

pytestmark = pytest.mark.parity

RTOL = 1e-5
# (images as (grid_h, grid_w), text tokens) per sample; max_tokens packs them into 2 rows
SAMPLES = [([(4, 8)], 5), ([], 13), ([(2, 4), (4, 4)], 3), ([], 6), ([(4, 6)], 9)]
MAX_TOKENS = 40


def _samples(hf) -> list[Sample]:
    from dhp.models.testing import tiny_vl_batch

    out = []
    for k, (images, n_text) in enumerate(SAMPLES):
        b = tiny_vl_batch(hf, images=[images], text_lens=[n_text], seed=k)
        out.append(
            Sample(
                sample_id=f"s{k}",
                input_ids=b["input_ids"][0],
                labels=b["labels"][0],
                mm_token_type_ids=b["mm_token_type_ids"][0],
                pixel_values=b["pixel_values"],
                image_grid_thw=b["image_grid_thw"],
            )
        )
    return out


def _embeds(batch, hf, seed: int) -> torch.Tensor | None:
    n = int((batch.input_ids == hf.image_token_id).sum())
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, hf.text_config.hidden_size, generator=gen) if n else None


def _forward(module, batch, embeds):
    return module(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        labels=batch.labels,
        mm_token_type_ids=batch.mm_token_type_ids,
        image_grid_thw=batch.image_grid_thw,
        image_embeds=embeds,
        sample_ids=batch.sample_ids,
    )


def _reference(family, hf, samples):
    """Each sample alone through the single-process module; summed loss, grads, image-embeds grad."""
    torch.manual_seed(0)
    ref = family.build_module("llm", hf, device="cpu", dtype=torch.float32)
    packed = pack(samples, max_tokens=MAX_TOKENS, pad_token_id=hf.text_config.pad_token_id)
    all_embeds = _embeds(packed, hf, seed=3)
    leaf = all_embeds.clone().requires_grad_(True)
    loss, tokens, at = 0.0, 0, 0
    for one in unpack(packed):
        n = int((one.input_ids == hf.image_token_id).sum())
        out = _forward(ref, one, leaf[at : at + n] if n else None)
        at += n
        loss = loss + out.loss_sum
        tokens += out.num_tokens
    loss.backward()
    return (
        packed,
        all_embeds,
        loss.detach(),
        tokens,
        {k: p.grad for k, p in ref.named_parameters()},
        leaf.grad,
    )


def _cpu_varlen(module, query, key, value, attention_mask, *, cu_seq_lens_q=None, **kwargs):
    """A stand-in "flash" kernel on CPU: causal SDPA per ``cu_seq_lens`` sequence of the flattened rows."""
    assert attention_mask is None and cu_seq_lens_q is not None, "the varlen kwargs did not arrive"
    b, h, s, d = query.shape
    rep = h // key.shape[1]
    q, k, v = (x.transpose(1, 2).reshape(b * s, -1, d) for x in (query, key, value))
    out = torch.empty_like(q)
    bounds = cu_seq_lens_q.tolist()
    for lo, hi in itertools.pairwise(bounds):
        qi, ki, vi = (x[lo:hi].transpose(0, 1) for x in (q, k, v))
        ki, vi = ki.repeat_interleave(rep, 0), vi.repeat_interleave(rep, 0)
        out[lo:hi] = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True).transpose(0, 1)
    return out.reshape(b, s, h, d), None


AttentionInterface.register("flash_cpu_varlen_test", _cpu_varlen)


@pytest.mark.parametrize("attn", ["sdpa", "flash_cpu_varlen_test"])
def test_packing_matches_unpacked_sum_single_process(attn: str) -> None:
    """SDPA (block-diagonal mask from restarting positions) and the varlen path: loss, label count,
    every parameter grad and the image-embedding grad equal the per-sample sum."""
    from dhp.models import get_family

    family = get_family("qwen2_5_vl")
    hf = family.hf_config(family.tiny_model_config())
    samples = _samples(hf)
    packed, embeds, ref_loss, ref_tokens, ref_grads, ref_gin = _reference(family, hf, samples)
    assert packed.input_ids.shape[0] == 2 and is_packed(packed.attention_mask)
    assert packed.num_label_tokens == sum(s.num_label_tokens for s in samples) == ref_tokens
    torch.manual_seed(0)
    mod = family.build_module("llm", hf, device="cpu", dtype=torch.float32)
    mod.language_model.config._attn_implementation = attn
    leaf = embeds.clone().requires_grad_(True)
    out = _forward(mod, packed, leaf)
    out.loss_sum.backward()
    assert out.num_tokens == ref_tokens
    assert_rel_close(out.loss_sum, ref_loss, rtol=RTOL, name=f"{attn} loss")
    assert_grads_match({k: p.grad for k, p in mod.named_parameters()}, ref_grads, rtol=RTOL, tag=attn)
    assert_rel_close(leaf.grad, ref_gin, rtol=RTOL, name=f"{attn} d/d image_embeds")


def _tp_sp(rank: int, world: int) -> None:
    from dhp.models import get_family
    from dhp.parallel.llm_tp import apply_tp, sequence_shard_rows

    family = get_family("qwen2_5_vl")
    hf = family.hf_config(family.tiny_model_config())
    packed, embeds, ref_loss, ref_tokens, ref_grads, ref_gin = _reference(family, hf, _samples(hf))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    sp = apply_tp(
        family.build_module("llm", hf, device="cpu", dtype=torch.float32),
        mesh,
        sequence_parallel=True,
        loss_chunk_tokens=7,
    )
    own = sequence_shard_rows(packed.input_ids, hf.image_token_id, tp=world, rank=rank)
    leaf = (embeds * own.unsqueeze(1)).requires_grad_(True)  # the hand-off: own shard's rows only
    out = _forward(sp, packed, leaf)
    out.loss_sum.backward()
    assert out.num_tokens == ref_tokens
    assert_rel_close(out.loss_sum, ref_loss, rtol=RTOL, name="tp+sp packed loss")
    assert_grads_match(full_grads(sp), ref_grads, rtol=RTOL, tag="tp+sp packed")
    assert_rel_close(leaf.grad, ref_gin, rtol=RTOL, name="tp+sp packed d/d image_embeds")


def test_packing_tp2_sequence_parallel_matches_unpacked_sum() -> None:
    """LLM TP 2 with SP (odd packed length, padded inside; 7-token loss chunks) against the per-sample sum."""
    spawn(_tp_sp, 2)


# --- the Qwen3 base families: Qwen3-VL (DeepStack), its MoE flavour, Qwen3.5 (Gated DeltaNet) --------

#: transformers' chunk of the torch chunked gated delta rule (``torch_chunk_gated_delta_rule``)
DELTA_CHUNK = 64
# (images as (grid_h, grid_w) in patches of 16 px, merge 2: h*w/4 tokens; text tokens) per sample: 53,
# 53, 29, 26 and 40 tokens, packed by first-fit decreasing into rows of 106 and 95 tokens (two delta-rule
# chunks each); the samples start at 0, 53 and 0, 29, 55: inside a chunk, and the second sample of each
# row runs across the chunk boundary at 64
QWEN3_SAMPLES = [([(4, 8)], 40), ([], 53), ([(2, 4), (4, 4)], 13), ([], 26), ([(4, 6)], 29)]
QWEN3_MAX_TOKENS = 128
#: (family, moe) of each case; the fast tier runs Qwen3.5 (DeltaNet + full attention), the rest are slow
QWEN3_CASES = [
    pytest.param("qwen3_5", False, id="qwen3_5"),
    pytest.param("qwen3_5", True, id="qwen3_5_moe", marks=pytest.mark.slow),
    pytest.param("qwen3_vl", False, id="qwen3_vl", marks=pytest.mark.slow),
    pytest.param("qwen3_vl", True, id="qwen3_vl_moe", marks=pytest.mark.slow),
]


def _qwen3_case(family_name: str, moe: bool):
    """(family, hf config, packed batch, the same samples unpacked in the packed row-major order, the
    vision module's output rows: image_embeds and every DeepStack level)."""
    from dhp.data.batch import collate
    from dhp.models import get_family
    from dhp.models.testing import tiny_vl_batch

    family = get_family(family_name)
    hf = family.tiny_hf_config(moe=moe)
    samples = []
    for k, (images, n_text) in enumerate(QWEN3_SAMPLES):
        b = tiny_vl_batch(hf, images=[images], text_lens=[n_text], seed=k)
        samples.append(
            Sample(
                f"s{k}",
                b["input_ids"][0],
                b["labels"][0],
                b["mm_token_type_ids"][0],
                pixel_values=b["pixel_values"],
                image_grid_thw=b["image_grid_thw"],
            )
        )
    pad = hf.text_config.pad_token_id
    packed = pack(samples, max_tokens=QWEN3_MAX_TOKENS, pad_token_id=pad)
    order = [int(i[1:]) for row in packed.sample_ids for i in row.split("+")]
    unpacked = collate([samples[i] for i in order], pad_token_id=pad)  # images in the packed order
    n_img = int((packed.input_ids == hf.image_token_id).sum())
    gen = torch.Generator().manual_seed(3)
    width = hf.text_config.hidden_size
    rows = {e.kwarg: torch.randn(n_img, width, generator=gen) for e in family.handoffs_for(hf)}
    return family, hf, packed, unpacked, rows


def _build_llm(family, hf):
    """The family's LLM module, seed 0, fp32; every Gated DeltaNet's ``A_log`` redrawn as log U(0.01, 1)
    (as tests/parity/test_split_qwen3_5.py: transformers' log U(0.01, 16) makes most tiny heads forget
    their state within a token, so a state leaking from one sample into the next would hardly show, and
    their dt_bias / A_log gradients only measure fp32 rounding)."""
    torch.manual_seed(0)
    module = family.build_module("llm", hf, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for fqn, param in module.named_parameters():
            if fqn.endswith("linear_attn.A_log"):
                param.copy_(torch.rand(param.shape, generator=gen).mul_(0.99).add_(0.01).log_())
    return module


def _assert_chunk_crossing(packed) -> None:
    """Some sample starts inside a delta-rule chunk of its row and some runs across a chunk boundary."""
    runs = [
        (s, e)
        for r in range(packed.input_ids.shape[0])
        for s, e, k in segments(packed.attention_mask[r])
        if k
    ]
    assert any(s % DELTA_CHUNK for s, _ in runs), runs
    assert any(s // DELTA_CHUNK != (e - 1) // DELTA_CHUNK for s, e in runs), runs


def _run(module, batch, rows: dict[str, torch.Tensor]):
    """Forward + backward of ``loss_sum``; (output, parameter grads, edge-row grads)."""
    leaves = {k: v.clone().requires_grad_(True) for k, v in rows.items()}
    out = module(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        labels=batch.labels,
        mm_token_type_ids=batch.mm_token_type_ids,
        image_grid_thw=batch.image_grid_thw,
        sample_ids=batch.sample_ids,
        **leaves,
    )
    out.loss_sum.backward()
    grads = {k: p.grad for k, p in module.named_parameters() if p.grad is not None}
    return out, grads, {k: v.grad for k, v in leaves.items()}


def _assert_same_step(got, want, *, tag: str, moe: bool) -> None:
    (out, grads, row_grads), (ref, ref_grads, ref_row_grads) = got, want
    assert out.num_tokens == ref.num_tokens, tag
    assert_rel_close(out.loss_sum, ref.loss_sum, rtol=RTOL, name=f"{tag} loss")
    assert_grads_match(grads, ref_grads, rtol=QWEN3_GRAD_RTOL, tag=tag)
    for k in ref_row_grads:  # image_embeds and, in Qwen3-VL, every DeepStack level
        assert_rel_close(row_grads[k], ref_row_grads[k], rtol=QWEN3_GRAD_RTOL, name=f"{tag} d/d {k}")
    if moe:  # the router's load-balancing loss over the same tokens, and its gradient compared above
        from dhp.models.qwen3_base import ROUTER_AUX_LOSS

        assert any(k.endswith("mlp.gate.weight") for k in ref_grads), sorted(ref_grads)
        aux, ref_aux = out.aux_losses[ROUTER_AUX_LOSS], ref.aux_losses[ROUTER_AUX_LOSS]
        assert_rel_close(aux, ref_aux, rtol=RTOL, name=f"{tag} router aux loss")


#: gradients of the Qwen3 families (norm sense). Measured packed vs unpacked, one process: the largest
#: gradient error 6.0e-6 (Qwen3.5; its MoE flavour 3.3e-6: A_log / dt_bias, sums over every token),
#: 4e-7 in Qwen3-VL and its MoE flavour, the loss equal; the DeltaNet layers run their rule (in fp32)
#: on other batch shapes than unpacked. Without the per-sample split (the rows' samples mixed) the
#: Qwen3.5 loss is off by 2.6e-4 and the worst gradient by 0.86.
QWEN3_GRAD_RTOL = 1e-4


@pytest.mark.parametrize(("family_name", "moe"), QWEN3_CASES)
def test_qwen3_packing_matches_the_unpacked_batch(family_name: str, moe: bool) -> None:
    """A packed micro-batch (2 rows) against the same samples right-padded (5 rows), one process, fp32:
    the loss, the label count, every parameter's gradient (the router's in the MoE flavours), the
    gradient of every vision-output row (image_embeds, DeepStack levels) and the router's auxiliary
    loss. Qwen3.5's DeltaNet layers run every sample alone (``dhp.parallel.linear_attn_packed``)."""
    family, hf, packed, unpacked, rows = _qwen3_case(family_name, moe)
    assert packed.input_ids.shape[0] == 2 and is_packed(packed.attention_mask)
    _assert_chunk_crossing(packed)
    results = []
    for batch in (packed, unpacked):
        results.append(_run(_build_llm(family, hf), batch, rows))
    _assert_same_step(results[0], results[1], tag=f"{family_name}{' moe' if moe else ''} packed", moe=moe)


def test_qwen3_5_packing_survives_full_activation_checkpointing() -> None:
    """Full AC recomputes every decoder layer in backward: the DeltaNet layers read the samples from
    their mask argument, so the recompute splits them again (a context set around the forward would be
    gone by then and the recompute would mix the samples). Packed with AC vs unpacked without."""
    from dhp.parallel.ac import AcSpec, apply_ac

    family, hf, packed, unpacked, rows = _qwen3_case("qwen3_5", False)
    ac = apply_ac(_build_llm(family, hf), None, AcSpec(kind="full"))
    got = _run(ac.train(), packed, rows)
    want = _run(_build_llm(family, hf), unpacked, rows)
    _assert_same_step(got, want, tag="qwen3_5 packed, full AC", moe=False)


def _qwen3_5_parallel(rank: int, world: int, kind: str) -> None:
    """Qwen3.5 packed under ``kind`` (``tp_sp``: TP 2 with sequence parallelism; ``cp``: context
    parallelism 2) against the same samples unpacked in one process. Each rank gets the vision rows
    its tokens take (TP + SP: its sequence shard's, the others zero; CP: its own tokens' rows)."""
    from dhp.layout import ParallelLayout
    from dhp.ops.context import rank_index
    from dhp.parallel import build_mesh, finalize_grads, parallelize
    from dhp.parallel.llm_tp import apply_tp, sequence_shard_rows

    family, hf, packed, unpacked, rows = _qwen3_case("qwen3_5", False)
    ref, ref_grads, ref_rows = _run(_build_llm(family, hf), unpacked, rows)
    module = _build_llm(family, hf)
    placed = packed.input_ids == hf.image_token_id
    if kind == "tp_sp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        module = apply_tp(module, mesh, sequence_parallel=True, loss_chunk_tokens=7)
        own = sequence_shard_rows(packed.input_ids, hf.image_token_id, tp=world, rank=rank)
        got, _, got_rows = _run(module, packed, {k: v * own.unsqueeze(1) for k, v in rows.items()})
        loss, want_rows = got.loss_sum, ref_rows
    else:
        layout = ParallelLayout(cp=world)
        mesh = build_mesh(layout, "cpu")
        module = parallelize(
            "llm", module, mesh, layout, activation_checkpointing="off", mixed_precision="fp32"
        )
        seq = -(-packed.input_ids.shape[1] // layout.token_multiple) * layout.token_multiple
        idx = rank_index(seq, world, rank)
        order = torch.full(placed.shape, -1, dtype=torch.long)
        order[placed] = torch.arange(int(placed.sum()))
        mine = order[:, idx[idx < placed.shape[1]]]
        mine = mine[mine >= 0]  # this rank's image rows, in its local token order
        got, _, got_rows = _run(module, packed, {k: v[mine] for k, v in rows.items()})
        group = mesh["cp"].get_group()
        loss = got.loss_sum.detach().clone()
        dist.all_reduce(loss, group=group)
        tokens = torch.tensor([float(got.num_tokens)])
        dist.all_reduce(tokens, group=group)
        assert int(tokens) == ref.num_tokens
        finalize_grads(module, mesh, layout)
        want_rows = {k: v[mine] for k, v in ref_rows.items()}
    assert_rel_close(loss, ref.loss_sum, rtol=RTOL, name=f"{kind} packed loss")
    grads = {k: g for k, g in full_grads(module).items() if k in ref_grads}
    assert_grads_match(grads, ref_grads, rtol=QWEN3_GRAD_RTOL, tag=f"{kind} packed")
    for k in want_rows:
        assert_rel_close(got_rows[k], want_rows[k], rtol=QWEN3_GRAD_RTOL, name=f"{kind} packed d/d {k}")


def test_qwen3_5_packing_composes_with_context_parallelism() -> None:
    """cp=2: the full-attention layers mask by sample id (``ContextShard.text_mask``) and every DeltaNet
    layer gathers the whole sequence, then runs each sample of it alone (loss summed over the ranks,
    gradients after the SUM over cp, each rank's image rows)."""
    spawn(_qwen3_5_parallel, 2, "cp")


@pytest.mark.slow
def test_qwen3_5_packing_tp2_sequence_parallel_matches_unpacked() -> None:
    """TP 2 with sequence parallelism (7-token loss chunks): each DeltaNet layer all-gathers the
    sequence and runs every sample on its local heads."""
    spawn(_qwen3_5_parallel, 2, "tp_sp")
