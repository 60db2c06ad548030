"""Tensor parallelism of transformers' Qwen3.5 text model (Gated DeltaNet + gated full attention) vs one process.

A tiny random ``Qwen3_5TextModel`` (fp32, transformers' own code) with one Gated DeltaNet layer and one
gated full-attention layer, 2 key / 4 value linear heads, 96 tokens (two delta-rule chunks of 64,
right padding), under ``apply_tp`` at TP=2 on gloo: the decoder plan of ``dhp.parallel.llm_tp`` for
the full-attention layer, MLPs, embeddings and ``lm_head``, the per-head q/k norms, and
``dhp.parallel.linear_attn_tp``'s Gated DeltaNet style. Cases: plain TP, TP with sequence parallelism
(SP-in-TP), TP with full and with selective activation checkpointing, and FSDP2 x TP (4 ranks, with
SP and full AC) through ``parallelize``. Each compares the loss, every parameter's FULL gradient (and
the gradient w.r.t. the image embeddings) with the same module in one process, and checks that every
sharded DeltaNet parameter holds exactly 1/2 of its elements on each rank. The plain case also loads a
one-process DCP checkpoint at TP=2 and computes that checkpoint's loss.

Tolerance (fp32, CPU): loss within 1e-5 relative; every gradient within 1e-4 relative (norm sense).
TP only reorders fp32 sums (all-reduces, reduce-scatters); measured at TP=2: loss equal, the largest
gradient error 5.6e-6 (``A_log``, a sum over every token), the others ~1e-7.
"""

from __future__ import annotations

import shutil
import tempfile
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from parallel_harness import (
    HIDDEN,
    IMAGE_TOKEN,
    PAD,
    VOCAB,
    assert_grads_match,
    assert_rel_close,
    full_grads,
    llm_batch,
    spawn,
    split_llm,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet, Qwen3_5TextModel

from dhp.layout import ParallelLayout
from dhp.parallel import finalize_grads, parallelize
from dhp.parallel.ac import AcSpec, apply_ac
from dhp.parallel.linear_attn_tp import deltanet_tp_plan, head_norm_tp_plan, local_fraction
from dhp.parallel.llm_tp import apply_tp, decoder_tp_plan, local_loss_sum
from dhp.parallel.module_plan import ModuleParallelPlan

pytestmark = pytest.mark.parity

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
SEQ = 96  # two chunks of the chunked delta rule (chunk 64)


def text_config() -> Qwen3_5TextConfig:
    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=192,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def tp_plan(sequence_parallel: bool) -> dict:
    """The hybrid decoder's plan: what a Qwen3.5-style family composes from the generic pieces."""
    plan = decoder_tp_plan(model="language_model", lm_head="lm_head", sequence_parallel=sequence_parallel)
    plan.update(head_norm_tp_plan("language_model.layers.*.self_attn"))
    plan.update(deltanet_tp_plan("language_model.layers.*.linear_attn", sequence_parallel=sequence_parallel))
    return plan


class TinyHybridLLM(nn.Module):
    """The LLM module contract of dhp.models (``language_model``, ``lm_head``, ``loss_fn``) on transformers'
    Qwen3.5 text model; forward scatters image embeddings at image-token positions, returns the CE SUM."""

    def __init__(self, cfg: Qwen3_5TextConfig) -> None:
        super().__init__()
        self.language_model = Qwen3_5TextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.loss_fn = partial(local_loss_sum, chunk_tokens=0)
        self.parallel_plan = ModuleParallelPlan(
            blocks=("language_model.layers.*",),
            tp=tp_plan,
            tp_divides={
                "num_attention_heads": cfg.num_attention_heads,
                "num_key_value_heads": cfg.num_key_value_heads,
                "intermediate_size": cfg.intermediate_size,
                "vocab_size": cfg.vocab_size,
            },
            tp_sequence_parallel=True,
            loss=True,
            pad_token_id=PAD,
        )

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, image_embeds: torch.Tensor):
        embeds = self.language_model.embed_tokens(input_ids)
        mask = (input_ids == IMAGE_TOKEN).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(mask, image_embeds.to(embeds.dtype))
        b, s = input_ids.shape
        pos = torch.arange(s).view(1, 1, s).expand(3, b, s)
        attention_mask = (input_ids != PAD).long()  # right padding reaches the DeltaNet as a 2-D mask
        hidden = self.language_model(
            inputs_embeds=embeds, position_ids=pos, attention_mask=attention_mask
        ).last_hidden_state
        return self.loss_fn(hidden, self.lm_head, labels)


def step(model: nn.Module, batch: dict, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward (keyword inputs, as the runtime calls it) + backward of ``loss_sum / num_tokens``."""
    embeds = batch["image_embeds"].clone().requires_grad_(True)
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"], image_embeds=embeds) / num_tokens
    loss.backward()
    return loss.detach(), embeds.grad


def build(seed: int = 0) -> TinyHybridLLM:
    torch.manual_seed(seed)
    return TinyHybridLLM(text_config()).float()


def _check_deltanet_sharded(model: nn.Module, world: int, *, fsdp: int = 1) -> None:
    """Every DeltaNet parameter holds exactly 1/world of its elements on each rank (1/(world*fsdp) under
    FSDP2; the tiny sizes divide evenly, so no FSDP padding), except the gated norm's weight: one dv-sized
    weight shared by every head, replicated over TP (1/fsdp under FSDP2)."""
    layers = [m for m in model.modules() if isinstance(m, Qwen3_5GatedDeltaNet)]
    assert layers, "no Gated DeltaNet layer in the model"
    for layer in layers:
        frac = local_fraction(layer)
        names = {n for n, _ in layer.named_parameters()}
        assert set(frac) == names, f"not every DeltaNet parameter is a DTensor: {names - set(frac)}"
        for name, (local, whole) in frac.items():
            share = fsdp if name == "norm.weight" else world * fsdp
            assert local * share == whole, f"{name}: {local} of {whole} elements, want 1/{share}"
        assert (layer.num_k_heads, layer.num_v_heads) == (2 // world, 4 // world)


def _cases(rank: int, world: int, cases: tuple[str, ...]) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    batch = llm_batch(5, seq=SEQ)
    n_tok = int((batch["labels"][:, 1:] != -100).sum())
    ref = build()
    ref_loss, ref_gin = step(ref, batch, n_tok)
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    for case in cases:
        model = build()
        if case.startswith("ac_"):
            apply_ac(model, None, AcSpec(kind=case.removeprefix("ac_")))
        model = apply_tp(model, mesh, sequence_parallel=case == "sp")
        _check_deltanet_sharded(model, world)
        seen: list = []
        model.language_model.layers[0].input_layernorm.register_forward_hook(
            lambda m, i, o, seen=seen: seen.append(o)
        )
        calls: list = []
        model.language_model.layers[0].linear_attn.register_forward_pre_hook(
            lambda m, a, calls=calls: calls.append(1)
        )
        loss, gin = step(model, batch, n_tok)
        if case == "sp":  # the residual stream really is sequence-sharded around the DeltaNet layer
            assert isinstance(seen[0], DTensor) and seen[0].to_local().shape[1] == SEQ // world
        if case.startswith("ac_"):  # the DeltaNet forward ran again in backward (recompute)
            assert len(calls) == 2, calls
        assert_rel_close(loss, ref_loss, rtol=LOSS_RTOL, name=f"{case} loss")
        assert_grads_match(full_grads(model), ref_grads, rtol=GRAD_RTOL, tag=case)
        assert_rel_close(gin, ref_gin, rtol=GRAD_RTOL, name=f"{case} d/d image_embeds")
        if case == "tp":
            _check_checkpoint_maps(model, batch, n_tok)


def _check_checkpoint_maps(model: nn.Module, batch: dict, n_tok: int) -> None:
    """A DCP checkpoint of a one-process model (other weights: seed 1) loads into the TP=2 model, which then
    computes that model's loss: the DTensors' global layout is transformers' own (no permuted shard)."""
    path = [tempfile.mkdtemp(prefix="dcp_deltanet_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    other = build(seed=1)
    if dist.get_rank() == 0:
        dcp.save(other.state_dict(), checkpoint_id=path[0], no_dist=True)
    dist.barrier()
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path[0])
    set_model_state_dict(model, state)
    model.zero_grad(set_to_none=True)
    loss, _ = step(model, batch, n_tok)
    want, _ = step(other, batch, n_tok)
    assert_rel_close(loss, want, rtol=LOSS_RTOL, name="loss after loading a TP=1 DCP checkpoint at TP=2")
    qkv = model.language_model.layers[0].linear_attn.in_proj_qkv.weight.full_tensor()
    assert torch.equal(qkv, other.language_model.layers[0].linear_attn.in_proj_qkv.weight)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path[0])


def test_qwen3_5_text_tp2_matches_single_process() -> None:
    """TP=2: plain, with sequence parallelism, with full and with selective activation checkpointing
    (one spawn)."""
    spawn(_cases, 2, ("tp", "sp", "ac_full", "ac_selective"))


def _fsdp_tp_case(rank: int, world: int) -> None:
    """fsdp=2 x tp=2 with SP and full AC through ``parallelize`` (TP, then AC, then FSDP2 per layer):
    each FSDP replica runs half of the batch; the summed loss and every full grad equal one process."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    parallel = ParallelLayout(fsdp=2, tp=2, sequence_parallel=True)
    batch = llm_batch(6, batch=4, seq=SEQ)
    n_tok = int((batch["labels"][:, 1:] != -100).sum())
    ref = build()
    ref_loss, _ = step(ref, batch, n_tok)
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    model = parallelize(
        "llm", build(), mesh, layout=parallel, activation_checkpointing="full", mixed_precision="fp32"
    )
    _check_deltanet_sharded(model, 2, fsdp=2)
    loss, _ = step(model, split_llm(batch, mesh["fsdp"].get_local_rank(), 2), n_tok)
    finalize_grads(model, mesh, layout=parallel)
    dist.all_reduce(loss, group=mesh["fsdp"].get_group())
    assert_rel_close(loss, ref_loss, rtol=LOSS_RTOL, name="fsdp x tp loss")
    assert_grads_match(full_grads(model), ref_grads, rtol=GRAD_RTOL, tag="fsdp x tp")


def test_qwen3_5_text_fsdp2_tp2_sp_ac_matches_single_process() -> None:
    """4 ranks: FSDP2 over the TP-sharded DeltaNet layers, with SP-in-TP and full AC."""
    spawn(_fsdp_tp_case, 4)
