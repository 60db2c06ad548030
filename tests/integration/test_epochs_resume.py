"""A run by epochs resumes mid-epoch exactly, and a resume with another run length keeps (or, when
asked, moves) the LR horizon and says so (Ray, gloo, tiny_vlm).

Run U trains ``train.epochs=2`` over the 12 training samples of synthetic_small (4 of 16 held out for
the evaluation, ``data.eval.split=0.25``): 3 steps an epoch, 6 steps, a checkpoint every 2 (step 2 is
two thirds into epoch 1), an evaluation every 2 steps. Run B is U stopped at its step-2 checkpoint
and resumed with ``train.resume=auto``: steps 3-6 cross the epoch boundary with the same losses, LRs
and eval losses as U's, bit for bit (CPU fp32, the same plan). Runs K and W resume U's step-2
checkpoint with ``train.steps=4`` (U's schedule decays over 6): K keeps U's horizon (the default:
its LRs are U's), W asks for the new one (``train.resume_horizon=new``: another LR, reported).
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from dhp.metrics.rundir import read_run_log
from dhp.runtime.loop.train import train
from dhp.validation import load_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EPOCHS = [
    "train.steps=0",
    "train.epochs=2",
    "train.warmup_steps=1",
    "train.lr_schedule=linear",
    "train.checkpoint_every=2",
    "train.keep_last=5",
    "data.eval.split=0.25",
    "train.eval_every=2",
]


def _train(out: Path, name: str, *overrides: str) -> tuple[object, str]:
    cfg = load_config("tiny_vlm", [f"name={name}", f"train.output_dir={out}", *overrides])
    console = io.StringIO()
    return train(cfg, console=Console(file=console, width=250)), console.getvalue()


def _steps(run_dir: Path) -> dict[int, tuple[float, float]]:
    """``{step: (loss, lr)}`` of a run dir's metrics.jsonl."""
    return {r["step"]: (r["loss"], r["lr"]) for r in read_run_log(run_dir / "metrics.jsonl").records}


@pytest.fixture(scope="module")
def uninterrupted(ray_local, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    result, said = _train(out, "u", *EPOCHS)
    assert "train.epochs=2: 2 x 12 samples / 4 per step = 6 steps" in said
    return out, result


def test_resume_mid_epoch_gives_the_uninterrupted_losses_lrs_and_evals(uninterrupted) -> None:
    out, u = uninterrupted
    assert sorted(u.losses) == list(range(1, 7)) and sorted(u.evals) == [2, 4, 6]
    run = out / "b" / "20000101-000000"
    shutil.copytree(u.run_dir / "checkpoints" / "step_000002", run / "checkpoints" / "step_000002")
    shutil.copy(u.run_dir / "config.yaml", run / "config.yaml")
    head = [x for x in (u.run_dir / "metrics.jsonl").read_text().splitlines() if json.loads(x)["step"] <= 2]
    (run / "metrics.jsonl").write_text("".join(x + "\n" for x in head))
    meta = json.loads((run / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert meta["data_state"]["position"] == 8  # 8 of the epoch's 12 samples: mid-epoch
    b, _ = _train(out, "b", *EPOCHS, "train.resume=auto")
    want = _steps(u.run_dir)
    assert _steps(run) == {s: want[s] for s in range(1, 7)}  # exact: losses and LRs, epoch 2 included
    assert b.evals == {s: u.evals[s] for s in (4, 6)}
    log = read_run_log(run / "metrics.jsonl")
    assert [e["total_steps"] for e in log.events if e["event"] == "resume"] == [6]
    assert [r["data"]["epoch"] for r in log.records][-1] == 2.0


def test_a_changed_run_length_keeps_the_lr_horizon_unless_asked_and_says_so(uninterrupted) -> None:
    out, u = uninterrupted
    ckpt = u.run_dir / "checkpoints" / "step_000002"
    want = _steps(u.run_dir)
    shorter = [*EPOCHS, "train.epochs=0", "train.steps=4", f"train.resume={ckpt}"]
    keep, said = _train(out, "k", *shorter)
    assert "keeps the checkpoint's horizon (train.resume_horizon=keep)" in said
    assert {s: lr for s, (_, lr) in _steps(keep.run_dir).items()} == {s: want[s][1] for s in (3, 4)}
    new, said_new = _train(out, "w", *shorter, "train.resume_horizon=new")
    assert "train.resume_horizon=new): step 3 runs at lr" in said_new
    moved = _steps(new.run_dir)
    assert moved[3][1] != want[3][1]  # the LR the user asked for, not the checkpoint's
    (event,) = [e for e in read_run_log(new.run_dir / "metrics.jsonl").events if e["event"] == "start"]
    horizon = event["lr_horizon"]
    assert (horizon["checkpoint_total_steps"], horizon["run_total_steps"], horizon["kept"]) == (6, 4, False)
    assert horizon["lr_next_run"] == moved[3][1] and horizon["lr_next_checkpoint"] == want[3][1]
