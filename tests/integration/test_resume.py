"""Checkpoints end-to-end (Ray, gloo, tiny_vlm): exact resume and resharded resume.

Run A trains 10 steps with a checkpoint every 5 (keep_last=1 keeps only step 10 at the end, so A
also exercises pruning); run B, a copy of A stopped at its step-5 checkpoint, resumes with
``train.resume=auto`` in its own run dir and must give BIT-IDENTICAL losses at steps 6-10 (CPU
fp32, same reduction order); run C resumes the step-5 checkpoint from another run's dir (so in a
new run dir of its own) with the LLM at TP=1 instead of TP=2 (DCP reshards) and must match within
1e-5 relative (different reduction order in the TP matmuls, nothing else).

The runs A, B, C and Z go through ``dhp.runtime.loop.train.train`` (what ``dhp train`` calls) on the
module's shared local Ray; the refused resume, the killed-actor restart and the export go through
the real CLI, whose exit codes, process tree and output they check.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from procs import descendants

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 10, 5


def dhp(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the installed CLI (`python -m dhp.cli`) and return the finished process."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "dhp.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def losses(out: Path, name: str) -> dict[int, float]:
    """{step: loss} from the single run directory of ``name`` under ``out``."""
    runs = sorted((out / name).iterdir())
    assert len(runs) == 1, runs
    rows = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def train(out: Path, name: str, *overrides: str) -> None:
    """``dhp train conf=tiny_vlm name=NAME ...`` in this process (on the shared local Ray)."""
    from rich.console import Console

    from dhp.runtime.loop.train import train as run_train
    from dhp.validation import load_config

    run = [
        f"name={name}",
        f"train.output_dir={out}",
        f"train.steps={STEPS}",
        f"train.checkpoint_every={EVERY}",
    ]
    cfg = load_config("tiny_vlm", [*run, *overrides])
    run_train(cfg, console=Console(file=io.StringIO()))


@pytest.fixture(scope="module")
def full_run(ray_local, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float], Path]:
    """Run A (uninterrupted, keep_last=2) and a copy of its step-5 checkpoint in its own run dir."""
    out = tmp_path_factory.mktemp("runs")
    train(out, "a", "train.keep_last=2")
    (run_a,) = (out / "a").iterdir()
    ckpts = sorted(p.name for p in (run_a / "checkpoints").iterdir())
    assert ckpts == ["step_000005", "step_000010"], ckpts
    # resume=PATH from a copy inside another run dir (its config.yaml next to checkpoints/)
    src = out / "src" / "20000101-000000"
    shutil.copytree(run_a / "checkpoints" / "step_000005", src / "checkpoints" / "step_000005")
    shutil.copy(run_a / "config.yaml", src / "config.yaml")
    return out, losses(out, "a"), src / "checkpoints" / "step_000005"


def test_uninterrupted_run_checkpoints_every_n(full_run, tmp_path: Path) -> None:
    out, a, _ = full_run
    assert sorted(a) == list(range(1, STEPS + 1))
    meta = json.loads(next((out / "a").iterdir()).joinpath("checkpoints/step_000010/meta.json").read_text())
    assert meta["step"] == STEPS and set(meta["modules"]) == {"vision", "llm"}


def test_resume_auto_continues_its_run_dir_bit_exact(full_run) -> None:
    """Run B stopped after its step-5 checkpoint (A's files up to step 5, copied into B's run dir);
    ``train.resume=auto`` continues that run dir: one metrics.jsonl holding steps 1-5, a resume
    event and steps 6-10, the steps after the checkpoint bit-identical to A's."""
    out, a, _ = full_run
    (run_a,) = (out / "a").iterdir()
    run = out / "b" / "20000101-000000"
    shutil.copytree(run_a / "checkpoints" / "step_000005", run / "checkpoints" / "step_000005")
    shutil.copy(run_a / "config.yaml", run / "config.yaml")
    head = (run_a / "metrics.jsonl").read_text().splitlines()[:EVERY]
    (run / "metrics.jsonl").write_text("".join(x + "\n" for x in head))
    train(out, "b", "train.resume=auto")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("event", r["step"]) for r in rows] == [1, 2, 3, 4, 5, "resume", 6, 7, 8, 9, 10], rows
    b = losses(out, "b")  # one run dir: the resume wrote no other
    assert b == a  # exact: CPU fp32, same plan, same data position and RNG
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000005", "step_000010"]


def _resume_under(full_run, name: str, *plan: str) -> None:
    """Resume A's step-5 checkpoint under another ``plan``: steps 6-10 equal A's within 1e-5 relative."""
    out, a, ckpt = full_run
    train(out, name, f"train.resume={ckpt}", *plan)
    got = losses(out, name)
    assert sorted(got) == list(range(EVERY + 1, STEPS + 1))
    for s, loss in got.items():
        # another plan sums in another order (TP matmul splits, DP sums): fp32 rounding only (~1e-7)
        assert loss == pytest.approx(a[s], rel=1e-5), (s, loss, a[s])


def test_resume_llm_tp2_to_tp1_reshards(full_run) -> None:
    # LLM TP=2 -> TP=1 (1 rank, so the groups move to disjoint devices: collocated -> disaggregated)
    _resume_under(full_run, "c", "placement=disaggregated", "modules.llm.gpus=1", "modules.llm.parallel.tp=1")


def test_resume_other_architecture_is_refused(full_run) -> None:
    out, _, ckpt = full_run
    proc = dhp(
        "train",
        "conf=tiny_vlm",
        "name=d",
        f"train.output_dir={out}",
        f"train.resume={ckpt}",
        "model.llm.num_layers=3",
    )
    assert proc.returncode == 2
    assert "CheckpointError" in proc.stderr + proc.stdout
    assert "model architecture differs" in proc.stderr + proc.stdout
    assert not (out / "d").exists()  # refused from meta.json alone: no run dir, no Ray, no actors
    assert "Started a local Ray" not in proc.stderr + proc.stdout


def _actor_pids(root: int) -> list[int]:
    out = []
    for pid in descendants(root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith("ray::ModuleWorker"):
            out.append(pid)
    return sorted(out)


def test_killed_actor_restarts_from_checkpoint_with_equal_losses(full_run, tmp_path: Path) -> None:
    """SIGKILL a random actor at a random step (seeded) with train.max_restarts=1: the driver names
    the module and rank, restarts every group from the newest verified checkpoint, records the
    restart in metrics.jsonl, and the run ends with the uninterrupted run's losses, bit for bit."""
    import random
    import signal
    import time

    _, a, _ = full_run
    rng = random.Random(14)
    kill_after = rng.randint(3, STEPS - 2)  # after the step-2 checkpoint, before the end
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "dhp.cli", "train", "conf=tiny_vlm", "name=k", f"train.output_dir={out}"]
    cmd += [f"train.steps={STEPS}", "train.checkpoint_every=2", "train.max_restarts=1"]
    cmd += ["train.restart_backoff_s=0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 400
        while True:
            rows = list(out.glob("k/*/metrics.jsonl"))
            if rows and rows[0].read_text().count("\n") >= kill_after:
                break
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the kill"
            time.sleep(0.2)
        pids = _actor_pids(proc.pid)
        assert pids, "no ray::ModuleWorker actor below the driver"
        os.kill(rng.choice(pids), signal.SIGKILL)
        text, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, text[-3000:]
    assert "restart 1" in text and "rank" in text, text[-3000:]
    (run,) = (out / "k").iterdir()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    events = [r for r in rows if r.get("event") == "restart"]
    assert len(events) == 1 and "rank" in events[0]["reason"], events
    k = {r["step"]: r["loss"] for r in rows if "loss" in r}  # a re-run step's later row wins
    assert sorted(k) == list(range(1, STEPS + 1))
    assert k == a  # exact: CPU fp32, the restart resumed model, optimizer, data position, LR and RNG


def test_export_of_a_trained_tp_checkpoint_loads_in_transformers(full_run, tmp_path: Path) -> None:
    """`dhp export` of run A's last checkpoint (LLM saved TP=2, vocab-parallel) -> from_pretrained, exact."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from dhp.checkpoint import load_module_state
    from dhp.models import get_family
    from dhp.validation import load_config

    out, _, _ = full_run
    (run_a,) = (out / "a").iterdir()
    proc = dhp("export", str(run_a), str(tmp_path / "hf"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "hf"))
    exported = get_family("qwen2_5_vl").split_state_dict(hf.state_dict())
    cfg = load_config(str(run_a / "config.yaml"), [])
    family = get_family(cfg.model.family)
    for name in ("vision", "llm"):
        module = family.build_module(name, family.hf_config(cfg.model), device="cpu", dtype=torch.float32)
        load_module_state(run_a / "checkpoints" / "step_000010" / name, model=module, optimizer=None)
        sd = module.state_dict()
        assert set(sd) == set(exported[name])
        assert all(torch.equal(sd[k], exported[name][k]) for k in sd), name


def test_resume_into_llm_zero1_dp2(full_run) -> None:
    """TP=2 AdamW state -> ZeRO-1 over dp=2 (each rank loads only the states it owns)."""
    _resume_under(
        full_run, "z", "modules.llm.parallel.tp=1", "modules.llm.parallel.dp=2", "modules.llm.parallel.zero=1"
    )


def test_resume_across_cp_2_to_1_to_2(ray_local, tmp_path: Path) -> None:
    """Context parallelism reshards like any other degree (its parameters are replicated over cp, its
    optimizer states are ZeRO-1's over dp x cp): a cp=2 run's step-2 checkpoint continues at cp=1, whose
    step-4 checkpoint continues at cp=2 again; every loss equals the uninterrupted cp=2 run's within
    1e-5 relative (the all-gather and the cut only reorder fp32 sums)."""
    steps = ["train.steps=6", "train.checkpoint_every=2", "train.keep_last=3"]
    cp2 = ["modules.llm.parallel.tp=1", "modules.llm.parallel.cp=2"]
    cp1 = ["placement=disaggregated", "modules.llm.gpus=1", "modules.llm.parallel.tp=1"]
    train(tmp_path, "x", *steps, *cp2)
    (run_x,) = (tmp_path / "x").iterdir()
    x = losses(tmp_path, "x")
    train(tmp_path, "y", *steps, *cp1, f"train.resume={run_x / 'checkpoints' / 'step_000002'}")
    (run_y,) = (tmp_path / "y").iterdir()
    train(tmp_path, "z", *steps, *cp2, f"train.resume={run_y / 'checkpoints' / 'step_000004'}")
    y, z = losses(tmp_path, "y"), losses(tmp_path, "z")
    assert sorted(y) == [3, 4, 5, 6] and sorted(z) == [5, 6]
    for s, loss in [*y.items(), *z.items()]:
        assert loss == pytest.approx(x[s], rel=1e-5), (s, loss, x[s])


def test_resume_across_pp_2_to_1_to_2(ray_local, tmp_path: Path) -> None:
    """Pipeline stages keep the unsplit FQNs, so a checkpoint reshards across pp like any degree: a
    pp=2 run's (two stages, one layer each, 1F1B over its 4 micro-batches) step-2 checkpoint continues
    at pp=1, whose step-4 checkpoint continues at pp=2 again; every loss equals the uninterrupted pp=2
    run's within 1e-5 relative (the same ops; only the fp32 grad-norm sum is ordered differently)."""
    steps = ["train.steps=6", "train.checkpoint_every=2", "train.keep_last=3"]
    batch = ["train.micro_batch_size=1", "train.global_batch_size=4"]
    pp2 = ["modules.llm.parallel.tp=1", "modules.llm.parallel.pp=2", *batch]
    pp1 = ["placement=disaggregated", "modules.llm.gpus=1", "modules.llm.parallel.tp=1", *batch]
    train(tmp_path, "x", *steps, *pp2)
    (run_x,) = (tmp_path / "x").iterdir()
    x = losses(tmp_path, "x")
    train(tmp_path, "y", *steps, *pp1, f"train.resume={run_x / 'checkpoints' / 'step_000002'}")
    (run_y,) = (tmp_path / "y").iterdir()
    train(tmp_path, "z", *steps, *pp2, f"train.resume={run_y / 'checkpoints' / 'step_000004'}")
    y, z = losses(tmp_path, "y"), losses(tmp_path, "z")
    assert sorted(x) == [1, 2, 3, 4, 5, 6] and sorted(y) == [3, 4, 5, 6] and sorted(z) == [5, 6]
    for s, loss in [*y.items(), *z.items()]:
        assert loss == pytest.approx(x[s], rel=1e-5), (s, loss, x[s])
