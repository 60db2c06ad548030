"""Expert parallelism through dhp's runtime pieces against transformers' single-process Qwen3-VL-MoE.

The text model of ``test_ep`` (same config, same seed on both sides) is parallelized by
``dhp.parallel.parallelize`` from a data plan (attention TP styles, the MoE blocks), trained 3 steps
with dhp's gradient pipeline (``finalize_grads`` -> ``grad_norm_sq`` -> ``clip_grads_`` with a fixed
coefficient 0.5 -> ``build_optimizer``'s AdamW step), and compared every step with the HF model run on
the whole batch with torch's AdamW:

(a) 2 ranks, fsdp=2 x ep=2: FSDP2 shards the dense parameters (router included) over the 2 ranks,
    the experts are sharded over the same 2 ranks by EP (FSDP ignores them); then the checkpoint
    through ``dhp.checkpoint``: the ep=2 state (model + AdamW) resumes into ep=1 and back into ep=2,
    exactly; the expert-load statistics of step 0 equal the counts of HF's router top-k; and the
    family's LLM built on meta at fsdp=2 x ep=2 loads its shards from a tiny HF directory exactly;
(b) 4 ranks, dp=2 x tp=2 x ep=2: attention TP=2 (q/k/v column-, o row-parallel), the EP group folded
    over dp inside each tp index (the tp ranks route the same tokens and run the same experts); then
    two plans with edp = 2 (each expert shard on 2 ranks, its grads summed over them): dp=4 with
    ZeRO-1 (the other parameters' states partitioned over dp=4, the experts' over edp=2: each rank
    holds the states of exactly 1/(ep x edp) of the experts' elements; they resume through
    ``dhp.checkpoint`` into the same plan and into ep=1, exactly) and dp=2 x fsdp=2 (HSDP beside
    EP) under full activation checkpointing (backward re-runs the all-to-alls; the expert load
    counts them once).

Tolerances (fp32 on CPU; only float summation order differs): loss <= 1e-5 relative; every gradient
(router and experts included) <= 1e-4 relative (norm sense) and <= 1e-4 max absolute; the
grad norm (over TP, FSDP and expert shards at once) <= 1e-5 relative. A missing reduction or a double-counted expert shard errs by >= 1e-2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from parallel_harness import spawn
from test_ep import AUX_COEF, SEQ, VOCAB, E, K, _close, build
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

from dhp.checkpoint import load_module_state, save_module_state
from dhp.config.schema import TrainConfig
from dhp.layout import ParallelLayout
from dhp.models import get_family
from dhp.models.loading import build_and_load, load_module_weights
from dhp.models.tiny import make_tiny_checkpoint
from dhp.parallel import (
    build_optimizer,
    clip_grads_,
    finalize_grads,
    full_grad_dict,
    full_param_dict,
    grad_norm_sq,
    parallelize,
)
from dhp.parallel.ep import expert_params
from dhp.parallel.expert_load import summarize, track_expert_load
from dhp.parallel.load_balancing import load_balancing_loss
from dhp.parallel.module_plan import ModuleParallelPlan

pytestmark = pytest.mark.parity

LOSS_RTOL, GRAD_RTOL, NORM_RTOL, COEF = 1e-5, 1e-4, 1e-5, 0.5
MOE_BLOCKS = "language_model.layers.*.mlp"
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.01}


def _plan() -> ModuleParallelPlan:
    attn = "language_model.layers.*.self_attn"
    styles = {f"{attn}.{p}_proj": ColwiseParallel() for p in "qkv"} | {f"{attn}.o_proj": RowwiseParallel()}
    # q_norm/k_norm run on this rank's heads: a replicated weight whose grad DTensor sums over TP
    styles |= {
        f"{attn}.{n}": SequenceParallel(sequence_dim=2, use_local_output=True) for n in ("q_norm", "k_norm")
    }
    return ModuleParallelPlan(
        blocks=("language_model.layers.*",),
        tp=lambda sequence_parallel: styles,
        tp_divides={"num_attention_heads": 4, "num_key_value_heads": 2},
        moe_blocks=MOE_BLOCKS,
        experts=E,
    )


def _train() -> TrainConfig:
    train = TrainConfig(lr=ADAMW["lr"], betas=list(ADAMW["betas"]), weight_decay=ADAMW["weight_decay"])
    train.optimizer.impl = "foreach"
    return train


def _dhp_model(mesh, parallel: ParallelLayout, ac: str = "off"):
    model = build()
    model.parallel_plan = _plan()
    parallelize("llm", model, mesh, layout=parallel, activation_checkpointing=ac, mixed_precision="fp32")
    return model, build_optimizer(model, mesh, layout=parallel, train=_train())


def _hf_counts(logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[layers, E] tokens per expert from HF's router logits (softmax -> top-k, as its router)."""
    return torch.stack(
        [
            torch.bincount(torch.topk(torch.softmax(x.float(), -1), K, -1).indices.reshape(-1), minlength=E)
            for x in logits
        ]
    )


def _train_case(
    mesh, parallel: ParallelLayout, *, data_axes: tuple[str, ...], ac: str = "off", steps: int = 3
):
    """3 steps of dhp's pipeline vs HF + torch AdamW; returns the trained (model, optimizer)."""
    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=True, **ADAMW)
    model, opt = _dhp_model(mesh, parallel, ac)
    assert len(expert_params(model)) == 4  # 2 MoE layers x (gate_up_proj, down_proj), sharded over ep
    load = track_expert_load(model, MOE_BLOCKS, duplicates=parallel.tp)
    data = mesh[data_axes[0]] if len(data_axes) == 1 else mesh[data_axes]._flatten("data")
    replica, replicas = data.get_local_rank(), data.size()
    tag = f"{mesh.mesh_dim_names} zero={parallel.zero} ep={parallel.ep} ac={ac}"
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (2 * replicas, SEQ), generator=torch.Generator().manual_seed(20 + step))
        n_labels = ids[:, 1:].numel()  # the GLOBAL label count: every replica divides by it
        ce, logits = ref(ids)
        loss_ref = ce / n_labels + AUX_COEF * load_balancing_loss_func(logits, E, K)
        loss_ref.backward()

        ce_r, logits_r = model(ids[2 * replica : 2 * replica + 2])
        share, _ = load_balancing_loss(logits_r, num_experts=E, top_k=K, group=data.get_group())
        loss_r = ce_r / n_labels + AUX_COEF * share
        loss_r.backward()
        finalize_grads(model, mesh, layout=parallel)
        norm_sq = grad_norm_sq(model, mesh)
        loss = loss_r.detach().clone()
        dist.all_reduce(loss, group=data.get_group())

        _close(loss, loss_ref, f"{tag} step {step} loss", rtol=LOSS_RTOL)
        grads = full_grad_dict(model)
        want = {n: p.grad for n, p in ref.named_parameters()}
        assert set(grads) == set(want), set(grads) ^ set(want)
        for name in want:
            _close(grads[name], want[name], f"{tag} step {step} grad {name}", rtol=GRAD_RTOL)
        want_norm = float(sum(p.grad.double().pow(2).sum() for p in ref.parameters())) ** 0.5
        rel = abs(norm_sq**0.5 - want_norm) / want_norm
        assert rel <= NORM_RTOL, f"{tag} step {step}: grad norm {norm_sq**0.5} vs {want_norm} ({rel:.1e})"
        if step == 0:  # expert-load statistics: the all-reduced top-k counts of every rank's tokens
            got = load.take(device=torch.device("cpu"))
            assert got == summarize(_hf_counts(logits)), (got, _hf_counts(logits))
        else:
            load.take(device=torch.device("cpu"))

        clip_grads_(model, COEF)  # on FSDP shards, TP shards and expert shards alike
        for p in ref.parameters():
            p.grad.mul_(COEF)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    return model, opt


def _full_optim(model, opt) -> dict[str, torch.Tensor]:
    """{fqn/state: full tensor} of the AdamW states (collective over the module's world)."""
    osd = get_optimizer_state_dict(model, opt)
    out = {}
    for fqn in sorted(osd["state"]):
        for k in sorted(osd["state"][fqn]):
            v = osd["state"][fqn][k]
            out[f"{fqn}/{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def assert_same_state(model, opt, want_p: dict, want_o: dict, tag: str) -> None:
    """Every full parameter and AdamW state of ``model``/``opt`` equals ``want_p``/``want_o``, bit for bit."""
    got_p, got_o = full_param_dict(model), _full_optim(model, opt)
    for name, w in want_p.items():
        assert torch.equal(got_p[name], w), f"{tag}: parameter {name} differs"
    assert set(got_o) == set(want_o), set(got_o) ^ set(want_o)
    for name, w in want_o.items():
        assert torch.equal(got_o[name], w), f"{tag}: optimizer state {name} differs"


def _reshard_case(mesh, model, opt, root: str) -> None:
    """dhp.checkpoint: ep=2 (fsdp=2) -> ep=1 (fsdp=2) -> ep=2, model and AdamW states bit for bit."""
    want_p, want_o = full_param_dict(model), _full_optim(model, opt)
    save_module_state(Path(root, "ep2"), model=model, optimizer=opt, extra={})
    for ep, src, dst in ((1, "ep2", "ep1"), (2, "ep1", None)):
        resumed, ropt = _dhp_model(mesh, ParallelLayout(fsdp=2, ep=ep))
        assert bool(expert_params(resumed)) == (ep == 2)
        for p in resumed.parameters():  # AdamW states must exist to be loaded into: a zero step
            p.grad = torch.zeros_like(p)
        ropt.step()
        load_module_state(Path(root, src), model=resumed, optimizer=ropt)
        assert_same_state(resumed, ropt, want_p, want_o, f"ep=2 -> ep={ep}")
        if dst is not None:
            save_module_state(Path(root, dst), model=resumed, optimizer=ropt, extra={})


def _load_case(mesh, model_dir: str) -> None:
    """The runtime's build from ``model.path``: the family's LLM built on meta, EP (and FSDP) applied
    there, then only this rank's rows of each 3-D expert tensor read from the safetensors; the full
    tensors equal a single-process load of the same directory, and only half the expert bytes were read."""
    family = get_family("qwen3_vl_moe")
    hf = family.hf_config_from_dir(model_dir, attn_implementation="sdpa")
    module = family.build_module("llm", hf, device="meta", dtype=torch.float32)
    parallel = ParallelLayout(fsdp=2, ep=2)
    parallelize("llm", module, mesh, layout=parallel, activation_checkpointing="off", mixed_precision="fp32")
    report = load_module_weights(module, model_dir, family=family, module_name="llm", hf_config=hf,
                                 dtype=torch.float32, device="cpu")  # fmt: skip
    full, _ = build_and_load(family, "llm", model_dir, hf_config=hf, dtype=torch.float32, device="cpu")
    got, want = full_param_dict(module), dict(full.named_parameters())
    assert set(got) == set(want) and any(".experts." in n for n in got)
    for name, w in want.items():
        assert torch.equal(got[name], w), f"loaded {name} differs from the single-process load"
    experts = sum(p.to_local().numel() * 4 for _, p in expert_params(module))
    assert experts * 2 == sum(w.numel() * 4 for n, w in want.items() if ".experts." in n)
    assert report.bytes_read < sum(w.numel() * 4 for w in want.values())  # FSDP and EP: shards only


def _fsdp_ep(rank: int, world: int, root: str, model_dir: str) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    model, opt = _train_case(mesh, ParallelLayout(fsdp=2, ep=2), data_axes=("fsdp",))
    _reshard_case(mesh, model, opt, root)
    _load_case(mesh, model_dir)


def _expert_states_over_edp(model, opt) -> None:
    """ZeRO-1 with ep=2 x edp=2: this rank's AdamW states cover half of its expert shards' elements
    (the other edp rank owns the rest), so 1/(ep * edp) = 1/4 of all the experts' elements; the
    3 steps above matched HF only because the owners broadcast their updated experts over edp."""
    local_experts = {id(p): p.to_local().numel() for _, p in expert_params(model)}
    whole = sum(p.numel() for _, p in expert_params(model))  # the DTensors' global shape
    held = sum(local_experts[id(p)] for g in opt.param_groups for p in g["params"] if id(p) in local_experts)
    states = sum(s["exp_avg"].to_local().numel() for p, s in opt.state.items() if id(p) in local_experts)
    assert held == states and held * 4 == whole, (held, states, whole)


def _local_optim(model, opt) -> dict[str, torch.Tensor]:
    """{fqn/state: this rank's local tensor} of the AdamW states it holds (no collective on the states)."""
    osd = get_optimizer_state_dict(model, opt)
    return {f"{fqn}/{k}": v for fqn, st in osd["state"].items() for k, v in st.items() if k != "step"}


def _assert_local_states_equal(model, opt, full: dict, tag: str) -> int:
    """Every AdamW state this rank holds equals its slice of the checkpoint's full tensor, exactly;
    returns how many expert (DTensor) states it compared."""
    experts = 0
    for key, v in _local_optim(model, opt).items():
        fqn, k = key.rsplit("/", 1)
        w = full["optim"]["state"][fqn][k]
        if isinstance(v, DTensor):  # an expert state: Shard(0) over ep
            loc = v.to_local()
            lo = v.device_mesh.get_local_rank("ep") * loc.shape[0] if loc.shape[0] != w.shape[0] else 0
            w = w[lo : lo + loc.shape[0]]
            v, experts = loc, experts + 1
        assert torch.equal(v, w), f"{tag}: optimizer state {key} differs"
    return experts


def _zero1_resume_case(mesh, model, opt, root: str) -> None:
    """ZeRO-1 with the experts' states over edp through ``dhp.checkpoint``: each state is saved by its
    one owner; it resumes into the same plan and into ep=1 (the experts partitioned over dp with the
    rest), every rank's states equal to its slice of the checkpoint, bit for bit."""
    save_module_state(Path(root, "zero1"), model=model, optimizer=opt, extra={})
    dist.barrier()
    if dist.get_rank() == 0:
        dcp_to_torch_save(str(Path(root, "zero1")), str(Path(root, "zero1.pt")))
    dist.barrier()
    full = torch.load(Path(root, "zero1.pt"), weights_only=False)
    # 2 of the 4 expert tensors (1/edp) x (exp_avg, exp_avg_sq) on every rank
    assert _assert_local_states_equal(model, opt, full, "saved") == 4
    for ep in (2, 1):
        resumed, ropt = _dhp_model(mesh, ParallelLayout(dp=4, zero=1, ep=ep))
        for p in resumed.parameters():  # AdamW states must exist to be loaded into: a zero step
            p.grad = torch.zeros_like(p)
        ropt.step()
        load_module_state(Path(root, "zero1"), model=resumed, optimizer=ropt)
        _assert_local_states_equal(resumed, ropt, full, f"zero=1 ep=2 -> ep={ep}")


def _four_ranks(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    _train_case(mesh, ParallelLayout(dp=2, tp=2, ep=2), data_axes=("dp",))
    # edp = 2: expert grads summed over the 2 ranks holding the same experts, beside ZeRO-1 / HSDP
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model, opt = _train_case(mesh, ParallelLayout(dp=4, zero=1, ep=2), data_axes=("dp",))
    _expert_states_over_edp(model, opt)
    _zero1_resume_case(mesh, model, opt, root)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "fsdp"))
    _train_case(mesh, ParallelLayout(dp=2, fsdp=2, ep=2), data_axes=("dp", "fsdp"), ac="full")


def test_ep2_with_fsdp2_matches_hf_reshards_and_loads(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny_moe", family="qwen3_vl_moe")
    spawn(_fsdp_ep, 2, str(tmp_path), str(model_dir))


def test_ep2_with_attention_tp2_and_over_edp2_matches_hf(tmp_path):
    spawn(_four_ranks, 4, str(tmp_path))
