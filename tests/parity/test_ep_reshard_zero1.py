"""ZeRO-1 with EP through ``dhp.checkpoint``: a state saved at ep=2 resumes at ep=4 (4 gloo ranks, dp=4).

The text model and the training pipeline of ``test_ep_runtime`` (4 experts; dhp's finalize -> clip ->
``build_optimizer``'s ZeRO-1 AdamW, checked there against transformers + torch's AdamW): one step at
dp=4 x zero=1 x ep=2 (each expert shard on 2 ranks, edp=2: its AdamW states partitioned over them),
then ``save_module_state``. Into dp=4 x zero=1 x ep=4 (one expert per rank, edp=1) it resumes with:

- every parameter (gathered whole) equal to the saved one, bit for bit;
- every AdamW state each rank holds equal to its slice of the checkpoint's full tensor, bit for bit
  (expert states by the rank's ep index, the others by ZeRO-1's ownership);
- one more step from there, on the same batch on both plans: equal loss (<= 1e-5 relative) and equal
  parameters after the AdamW update (<= 1e-5 relative, norm sense; the two plans sum in another
  order), so the resumed moments are the ones the update uses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from parallel_harness import assert_rel_close, spawn
from test_ep import AUX_COEF, SEQ, VOCAB, E, K
from test_ep_runtime import _assert_local_states_equal, _dhp_model, _train_case
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh

from dhp.checkpoint import load_module_state, save_module_state
from dhp.layout import ParallelLayout
from dhp.parallel import finalize_grads, full_param_dict
from dhp.parallel.ep import expert_params
from dhp.parallel.load_balancing import load_balancing_loss

pytestmark = [pytest.mark.parity, pytest.mark.slow]
RTOL = 1e-5


def _step(model, opt, mesh, layout: ParallelLayout, seed: int) -> torch.Tensor:
    """One step on rank r's 2 rows of a 4 x 2-row batch; returns the step's loss (summed over dp)."""
    ids = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(seed))
    r = mesh.get_local_rank()
    ce, logits = model(ids[2 * r : 2 * r + 2])
    share, _ = load_balancing_loss(logits, num_experts=E, top_k=K, group=mesh.get_group())
    loss = ce / ids[:, 1:].numel() + AUX_COEF * share
    loss.backward()
    finalize_grads(model, mesh, layout=layout)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=mesh.get_group())
    return loss


def _case(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    saved_layout = ParallelLayout(dp=world, zero=1, ep=2)
    model, opt = _train_case(mesh, saved_layout, data_axes=("dp",), steps=1)
    save_module_state(Path(root, "ep2"), model=model, optimizer=opt, extra={})
    dist.barrier()
    if rank == 0:
        dcp_to_torch_save(str(Path(root, "ep2")), str(Path(root, "ep2.pt")))
    dist.barrier()
    full = torch.load(Path(root, "ep2.pt"), weights_only=False)
    want = full_param_dict(model)

    layout = ParallelLayout(dp=world, zero=1, ep=4)
    resumed, ropt = _dhp_model(mesh, layout)
    assert all(p.to_local().shape[0] == 1 for _, p in expert_params(resumed))  # one expert per rank
    for p in resumed.parameters():  # AdamW states must exist to be loaded into: a zero step
        p.grad = torch.zeros_like(p)
    ropt.step()
    load_module_state(Path(root, "ep2"), model=resumed, optimizer=ropt)
    got = full_param_dict(resumed)
    assert set(got) == set(want)
    bad = [n for n in want if not torch.equal(got[n], want[n])]
    assert not bad, f"ep=2 -> ep=4: parameters differ: {bad[:5]}"
    # this rank's states of the 4 expert tensors (its one expert of each): exp_avg and exp_avg_sq
    assert _assert_local_states_equal(resumed, ropt, full, "zero=1 ep=2 -> ep=4") > 0

    loss_saved = _step(model, opt, mesh, saved_layout, seed=77)
    loss_resumed = _step(resumed, ropt, mesh, layout, seed=77)
    assert_rel_close(loss_resumed, loss_saved, rtol=RTOL, name="loss after resume at ep=4")
    after, after_resumed = full_param_dict(model), full_param_dict(resumed)
    for name, w in after.items():
        assert_rel_close(after_resumed[name], w, rtol=RTOL, name=f"ep=4 resumed step: {name}")
        assert not torch.equal(w, want[name]), f"{name} did not move in the step"


def test_zero1_state_saved_at_ep2_resumes_at_ep4(tmp_path):
    spawn(_case, 4, str(tmp_path))
