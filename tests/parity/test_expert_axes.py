"""Expert TP (``etp = tp``) and expert FSDP (``expert_fsdp``) against transformers' single-process
Qwen3-VL-MoE text model, through dhp's runtime pieces (``parallelize`` -> ``finalize_grads`` ->
``grad_norm_sq`` -> ``clip_grads_`` -> ``build_optimizer``), 3 AdamW steps per plan, every step's loss,
every gradient and the grad norm compared with the HF model run on the whole batch (the harness of
``test_ep_runtime``: same model, seeds, tolerances and aux loss).

Fast tier, 2 ranks:
(a) dp=2 with expert FSDP (ep=1, edp=2): each rank holds half of every layer's experts (1/edp of their
    elements, and 1/edp of their AdamW states), the rest of the model replicated;
(b) tp=2 with etp=2 (ep=1): the 4 experts cut over the 2 TP ranks, each rank routing half of the
    (identical) tokens: no TP rank repeats another's expert work.
Slow tier, 4 ranks:
(c) fsdp=4 x ep=2 with expert FSDP (edp=2): 1/(ep x edp) = 1/4 of the experts' parameters and states
    per rank; its checkpoint (``dhp.checkpoint``) resumes, bit for bit, into ep=2 without expert
    FSDP, and that one's back into (c);
(d) dp=2 x tp=2 x ep=2 x etp=2: one all-to-all group of the 4 ranks, one expert per rank, under full
    activation checkpointing (the recompute gathers and routes again); resumes into etp=1 and back;
(e) fsdp=2 x tp=2 with etp=2 and expert FSDP (ep=1, edp=2): both axes at once.

Tolerances (fp32 on CPU): loss <= 1e-5 relative, every gradient <= 1e-4 relative and absolute, grad
norm <= 1e-5 relative. A gradient that is not gathered back over TP, or reduced twice over edp, errs
by >= 1e-2; a rank routing all of its unit's tokens under etp fails the routed-token count.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from parallel_harness import spawn
from test_ep import SEQ
from test_ep_runtime import _dhp_model, _full_optim, _train_case, assert_same_state
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dhp.checkpoint import load_module_state, save_module_state
from dhp.layout import ParallelLayout
from dhp.parallel import full_param_dict
from dhp.parallel.ep import ExpertParallelExperts, expert_params
from dhp.parallel.expert_tp import tp_rows

pytestmark = pytest.mark.parity


def _local(t: torch.Tensor) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).numel()


def _assert_expert_share(model, opt, parts: int) -> None:
    """This rank holds exactly 1/parts of the experts' elements, and AdamW states for exactly those."""
    experts = expert_params(model)
    whole = sum(p.numel() for _, p in experts)  # the DTensors' global shape
    held = sum(_local(p) for _, p in experts)
    ids = {id(p) for _, p in experts}
    states = sum(_local(s["exp_avg"]) + _local(s["exp_avg_sq"]) for p, s in opt.state.items() if id(p) in ids)
    assert held * parts == whole, f"rank holds {held} of {whole} expert elements, not 1/{parts}"
    assert states == 2 * held, f"AdamW states of {states // 2} expert elements, the rank holds {held}"


def _assert_routed_share(model, layout: ParallelLayout, rows_per_rank: int) -> None:
    """Under etp every TP rank routed only its balanced share of its unit's tokens in the last step."""
    tp = dist.get_rank() % layout.tp
    want = tp_rows(rows_per_rank, layout.etp, tp if layout.etp > 1 else 0)
    want_n = want[1] - want[0] if layout.etp > 1 else rows_per_rank
    got = {m.last_routed_tokens for m in model.modules() if isinstance(m, ExpertParallelExperts)}
    assert got == {want_n}, f"routed {got} tokens per MoE layer, want {want_n} of {rows_per_rank}"


def _two_ranks(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    lay = ParallelLayout(dp=2, expert_fsdp=True)
    model, opt = _train_case(mesh, lay, data_axes=("dp",))
    _assert_expert_share(model, opt, parts=2)

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))  # one replica: both see its batch
    lay = ParallelLayout(tp=2, etp=2)
    model, opt = _train_case(mesh, lay, data_axes=("dp",))
    _assert_expert_share(model, opt, parts=2)
    _assert_routed_share(model, lay, rows_per_rank=2 * SEQ)


def test_expert_fsdp_and_expert_tp_on_two_ranks_match_hf():
    spawn(_two_ranks, 2)


def _resume(mesh, layout: ParallelLayout, root: Path, want_p: dict, want_o: dict, tag: str):
    model, opt = _dhp_model(mesh, layout)
    for p in model.parameters():  # AdamW states must exist to be loaded into: a zero step
        p.grad = torch.zeros_like(p)
    opt.step()
    load_module_state(root, model=model, optimizer=opt)
    assert_same_state(model, opt, want_p, want_o, tag)
    return model, opt


def _round_trip(mesh, trained, other: ParallelLayout, model, opt, root: Path) -> None:
    """``model`` (at layout ``trained``) saved, resumed into ``other`` and saved again, resumed into
    ``trained``: parameters and AdamW states bit for bit each time."""
    want_p, want_o = full_param_dict(model), _full_optim(model, opt)
    save_module_state(root / "a", model=model, optimizer=opt, extra={})
    resumed, ropt = _resume(mesh, other, root / "a", want_p, want_o, f"{trained} -> {other}")
    save_module_state(root / "b", model=resumed, optimizer=ropt, extra={})
    _resume(mesh, trained, root / "b", want_p, want_o, f"{other} -> {trained}")


def _four_ranks(rank: int, world: int, root: str) -> None:
    fsdp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    efsdp = ParallelLayout(fsdp=4, ep=2, expert_fsdp=True)
    model, opt = _train_case(fsdp4, efsdp, data_axes=("fsdp",))
    _assert_expert_share(model, opt, parts=4)
    _round_trip(fsdp4, efsdp, ParallelLayout(fsdp=4, ep=2), model, opt, Path(root, "efsdp"))

    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    etp = ParallelLayout(dp=2, tp=2, ep=2, etp=2)
    model, opt = _train_case(dp_tp, etp, data_axes=("dp",), ac="full")
    _assert_expert_share(model, opt, parts=4)
    _assert_routed_share(model, etp, rows_per_rank=2 * SEQ)
    _round_trip(dp_tp, etp, ParallelLayout(dp=2, tp=2, ep=2), model, opt, Path(root, "etp"))

    fsdp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    both = ParallelLayout(fsdp=2, tp=2, etp=2, expert_fsdp=True)
    model, opt = _train_case(fsdp_tp, both, data_axes=("fsdp",))
    _assert_expert_share(model, opt, parts=4)
    _assert_routed_share(model, both, rows_per_rank=2 * SEQ)


@pytest.mark.slow
def test_expert_fsdp_and_expert_tp_with_ep_on_four_ranks_match_hf_and_reshard(tmp_path):
    spawn(_four_ranks, 4, str(tmp_path))
