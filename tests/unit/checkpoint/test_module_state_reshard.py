"""DCP save/load of a TP-sharded tiny module: same TP, TP=2 -> TP=1 (plain process), TP=1 -> TP=2.

Comparisons are EXACT (torch.equal): resharding only moves bytes, it must not change a value.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from ckpt_tiny import (
    apply_tp,
    close_gloo,
    free_port,
    full_state,
    init_gloo,
    tiny_text_model,
    train_step,
)

from dhp.checkpoint import load_module_state, save_module_state
from dhp.errors import CheckpointError

pytestmark = [pytest.mark.parity, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _new(tp: int, *, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tiny_text_model(seed=seed)
    if tp > 1:
        apply_tp(model, tp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save_tp2(rank: int, world: int, port: int, out: str) -> None:
    init_gloo(rank, world, port)
    model, opt = _new(world, seed=0)
    for s in range(2):
        train_step(model, opt, seed=s)
    save_module_state(Path(out) / "ckpt", model=model, optimizer=opt, extra={"rank": rank})
    ref = full_state(model, opt)
    if rank == 0:
        torch.save(ref, Path(out) / "ref.pt")
    close_gloo()


def _load_tp2(rank: int, world: int, port: int, src: str, out: str) -> None:
    init_gloo(rank, world, port)
    model, opt = _new(world, seed=123)  # different init: everything must come from the checkpoint
    train_step(model, opt, seed=99)  # populate optimizer state that the load must overwrite
    extra = load_module_state(Path(src), model=model, optimizer=opt)
    got = full_state(model, opt)
    if rank == 0:
        torch.save({"state": got, "extra": extra}, Path(out) / "got.pt")
    close_gloo()


def _assert_equal(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(ref)
    bad = [k for k in ref if not torch.equal(got[k], ref[k])]
    assert not bad, f"tensors differ after load: {bad[:5]}"


@pytest.fixture(scope="module")
def tp2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tp2")
    mp.start_processes(_save_tp2, args=(2, free_port(), str(out)), nprocs=2, join=True, start_method="fork")
    return out


def _load_on_two_ranks(ckpt: Path, out: Path) -> dict:
    """Load ``ckpt`` into a TP=2 module on two forked gloo ranks; rank 0's ``{"state", "extra"}``."""
    mp.start_processes(
        _load_tp2, args=(2, free_port(), str(ckpt), str(out)), nprocs=2, join=True, start_method="fork"
    )
    return torch.load(out / "got.pt", weights_only=True)


def test_tp2_to_tp2_exact(tp2_ckpt: Path, tmp_path: Path) -> None:
    got = _load_on_two_ranks(tp2_ckpt / "ckpt", tmp_path)
    _assert_equal(got["state"], torch.load(tp2_ckpt / "ref.pt", weights_only=True))
    assert got["extra"] == {"rank": 0}


def test_tp2_to_tp1_plain_process_exact_and_continues(tp2_ckpt: Path) -> None:
    model, opt = _new(1, seed=7)
    extra = load_module_state(tp2_ckpt / "ckpt", model=model, optimizer=opt)
    assert extra is None  # another world size: per-rank extras (RNG) do not apply
    _assert_equal(full_state(model, opt), torch.load(tp2_ckpt / "ref.pt", weights_only=True))
    # the loaded optimizer state is usable: one more step runs and moves every parameter
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(model, opt, seed=5)
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_tp1_to_tp2_exact(tmp_path: Path) -> None:
    model, opt = _new(1, seed=3)
    train_step(model, opt, seed=0)
    save_module_state(tmp_path / "ckpt", model=model, optimizer=opt, extra=None)
    torch.save(full_state(model, opt), tmp_path / "ref.pt")
    got = _load_on_two_ranks(tmp_path / "ckpt", tmp_path)
    _assert_equal(got["state"], torch.load(tmp_path / "ref.pt", weights_only=True))
    assert got["extra"] is None


def test_frozen_checkpoint_cannot_resume_trainable(tmp_path: Path) -> None:
    model, _ = _new(1, seed=0)
    save_module_state(tmp_path / "frozen", model=model, optimizer=None)
    fresh, opt = _new(1, seed=1)
    load_module_state(tmp_path / "frozen", model=fresh, optimizer=None)  # frozen -> frozen is fine
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    with pytest.raises(CheckpointError, match="frozen when it was saved"):
        load_module_state(tmp_path / "frozen", model=fresh, optimizer=opt)


def test_other_architecture_is_refused_with_names(tmp_path: Path) -> None:
    model, opt = _new(1, seed=0)
    save_module_state(tmp_path / "ckpt", model=model, optimizer=opt)
    wider = tiny_text_model(seed=0, hidden=64)
    with pytest.raises(CheckpointError, match=r"another global shape.*embed_tokens"):
        load_module_state(tmp_path / "ckpt", model=wider, optimizer=None)
