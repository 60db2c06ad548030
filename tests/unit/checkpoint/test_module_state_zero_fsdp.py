"""DCP round trips of ZeRO-1 (dhp.parallel Zero1AdamW, dp=2) and FSDP2 (fully_shard, 2 ranks) states.

Saved on 2 gloo ranks, reloaded in a plain single process (AdamW, no sharding) and compared EXACTLY
(torch.equal) with the union of what the ranks held: resharding moves bytes and changes no value.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ckpt_tiny import close_gloo, free_port, full_state, init_gloo, tiny_text_model, train_step
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dhp.checkpoint import load_module_state, save_module_state
from dhp.config.schema import TrainConfig
from dhp.layout import ParallelLayout

pytestmark = [
    pytest.mark.parity,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


def _zero1(model: torch.nn.Module, world: int) -> torch.optim.Optimizer:
    from dhp.parallel.dp import allreduce_grads_
    from dhp.parallel.optim import build_optimizer

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    opt = build_optimizer(
        model, mesh, layout=ParallelLayout(dp=world, zero=1), train=TrainConfig(lr=1e-2, betas=[0.9, 0.95])
    )
    step = opt.step

    def step_with_dp_sum(closure=None):  # the runtime sums grads over dp before stepping
        allreduce_grads_([p for p in model.parameters() if p.grad is not None], mesh.get_group())
        return step(closure)

    opt.step = step_with_dp_sum  # type: ignore[method-assign]
    return opt


def _fsdp(model: torch.nn.Module, world: int) -> torch.optim.Optimizer:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))


def _save(rank: int, world: int, port: int, kind: str, out: str) -> None:
    init_gloo(rank, world, port)
    model = tiny_text_model(seed=0)
    opt = _zero1(model, world) if kind == "zero1" else _fsdp(model, world)
    for s in range(2):
        train_step(model, opt, seed=10 * s + rank)  # different data per rank, as in DP
    save_module_state(Path(out) / "ckpt", model=model, optimizer=opt, extra={"rank": rank})
    if kind == "fsdp":
        state = full_state(model, opt)  # collective full_tensor of every shard
    else:  # ZeRO-1: each rank holds the states of the parameters it owns
        names = {p: n for n, p in model.named_parameters()}
        state = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
        state.update(
            {f"optim:{names[p]}:{k}": v.clone() for p, st in opt.state.items() for k, v in st.items()}
        )
    gathered: list = [None] * world
    dist.all_gather_object(gathered, state)
    if rank == 0:
        union: dict = {}
        for st in gathered:
            union.update(st)
        torch.save(union, Path(out) / "ref.pt")
    close_gloo()


@pytest.mark.parametrize("kind", ["zero1", "fsdp"])
def test_sharded_optimizer_state_reloads_unsharded_exactly(kind: str, tmp_path: Path) -> None:
    mp.start_processes(
        _save, args=(2, free_port(), kind, str(tmp_path)), nprocs=2, join=True, start_method="fork"
    )
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert any(k.endswith(":exp_avg") for k in ref)
    model = tiny_text_model(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    assert load_module_state(tmp_path / "ckpt", model=model, optimizer=opt) is None  # world 2 -> 1
    got = full_state(model, opt)
    assert sorted(got) == sorted(ref)
    bad = [k for k in ref if not torch.equal(got[k], ref[k])]
    assert not bad, f"differ after {kind} -> single-process load: {bad[:5]}"
