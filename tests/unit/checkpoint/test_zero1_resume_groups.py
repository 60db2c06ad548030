"""A ZeRO-1 state (dp=2, Zero1AdamW) saved and loaded through ``dhp.checkpoint`` into the same plan keeps
every optimizer group's settings on every rank, so the resumed run steps exactly like the saved one.

Under ZeRO-1 each rank's groups hold different parameters, while DCP stores the ``param_groups`` (a
non-tensor value) once: without ``load_module_state`` giving each rank its own parameter lists back,
the ranks whose parameters the stored lists do not name lose lr, betas, eps and weight_decay, and
their first step raises ``KeyError: 'betas'``. Compared exactly (torch.equal): same plan, same sums.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ckpt_tiny import close_gloo, free_port, init_gloo, tiny_text_model, train_step
from test_module_state_zero_fsdp import _zero1

from dhp.checkpoint import load_module_state, save_module_state

pytestmark = [pytest.mark.parity, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
SETTINGS = ("lr", "betas", "eps", "weight_decay")


def _run(rank: int, world: int, port: int, out: str) -> None:
    init_gloo(rank, world, port)
    try:
        model = tiny_text_model(seed=0)
        opt = _zero1(model, world)
        train_step(model, opt, seed=rank)
        save_module_state(Path(out), model=model, optimizer=opt, extra={})
        resumed = tiny_text_model(seed=5)
        ropt = _zero1(resumed, world)
        train_step(resumed, ropt, seed=99)  # states to load into
        load_module_state(Path(out), model=resumed, optimizer=ropt)
        lost = [
            (i, k)
            for i, (got, want) in enumerate(zip(ropt.param_groups, opt.param_groups, strict=True))
            for k in SETTINGS
            if k not in got or got[k] != want[k]
        ]
        bad = torch.tensor([len(lost)])
        dist.all_reduce(bad)  # every rank fails here together (a lone failing rank would hang the other)
        assert not int(bad), f"rank {rank}: (group, setting) lost or changed on load: {lost}"
        train_step(model, opt, seed=10 + rank)
        train_step(resumed, ropt, seed=10 + rank)
        for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
            assert torch.equal(p, q), f"rank {rank}: {name} differs one step after the resume"
        dist.barrier()
    finally:
        close_gloo()


def test_zero1_resume_keeps_every_rank_group_settings(tmp_path: Path) -> None:
    mp.start_processes(
        _run, args=(2, free_port(), str(tmp_path / "ckpt")), nprocs=2, join=True, start_method="fork"
    )
