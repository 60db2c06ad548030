"""Fault drills against real tiny runs of ``dhp train`` (Ray, gloo, tiny_vlm on CPU).

Each drill injects one class of fault (a killed actor, a corrupted/truncated/missing checkpoint
file, a signal, an unwritable or full disk, a nonsense config value, a foreign Ray head) and checks
the user-visible contract: the exit status (0 ok, 1 runtime, 2 config/data/checkpoint, 128+signal),
a message naming what and where, no Python traceback, no terminal colour codes in piped output, no
temp checkpoint dir left, and — where training continues — losses equal to an uninterrupted run.

    python scripts/fault_drills.py --out F.json [--only NAME ...] [--list]

Prints a pass/fail table and writes ``{"drills": [{"name", "passed", "detail"}]}``. Exit 1 if any
drill failed. Drills marked "data" exercise data-side guards and depend on the data loader's
bad-sample handling.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 4, 2
PLAN = ["placement=disaggregated", "modules.llm.gpus=1", "modules.llm.parallel.tp=1"]
TRACEBACK = "Traceback (most recent call last)"


class Drill(Exception):
    """A failed expectation; its message is the drill's detail."""


def expect(cond: bool, what: str, out: str = "") -> None:
    if not cond:
        raise Drill(what + (f" | output tail: {out[-600:]!r}" if out else ""))


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    e.pop("RAY_ADDRESS", None)
    return e


def dhp_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dhp.cli", *args]


def run(*args: str, timeout: int = 600) -> tuple[int, str]:
    p = subprocess.run(dhp_cmd(*args), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def train_args(out: Path, name: str, *extra: str, steps: int = STEPS) -> list[str]:
    return [
        "train",
        "conf=tiny_vlm",
        f"name={name}",
        f"train.output_dir={out}",
        f"train.steps={steps}",
        f"train.checkpoint_every={EVERY}",
        "train.keep_last=5",
        "train.restart_backoff_s=0",
        *PLAN,
        *extra,
    ]


def flat(text: str) -> str:
    """Console text without whitespace or panel borders: rich wraps long lines at spaces and frames
    error panels with box-drawing characters, so a phrase may be cut by a line break and a border."""
    return "".join(ch for ch in text if not ch.isspace() and not 0x2500 <= ord(ch) <= 0x257F)


def clean(text: str) -> None:
    """The user-facing contract every drill shares: no traceback, no colour codes when piped."""
    expect(TRACEBACK not in text, "a Python traceback reached the user", text)
    i = text.find("\x1b[")
    expect(i < 0, f"ANSI colour codes in non-TTY output: {text[max(0, i - 200) : i + 80]!r}")


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def no_tmp(out: Path) -> list[Path]:
    return [p for p in out.rglob("step_*.tmp-*")]


class Ctx:
    """Shared state: one uninterrupted base run, copied for the drills that damage checkpoints."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self._base: tuple[Path, dict[int, float]] | None = None

    def base(self) -> tuple[Path, dict[int, float]]:
        if self._base is None:
            out = self.work / "base"
            rc, text = run(*train_args(out, "base"))
            expect(rc == 0, f"the base run failed (rc={rc})", text)
            (run_dir,) = (out / "base").iterdir()
            self._base = (run_dir, losses(run_dir))
        return self._base

    def copy_base(self, tag: str) -> tuple[Path, Path]:
        """A copy of the base run under a fresh output dir; returns (output_dir, run_dir)."""
        run_dir, _ = self.base()
        out = self.work / tag
        dst = out / "base" / run_dir.name
        shutil.copytree(run_dir, dst)
        return out, dst


def _popen_train(out: Path, name: str, *extra: str, steps: int = STEPS) -> subprocess.Popen:
    return subprocess.Popen(
        dhp_cmd(*train_args(out, name, *extra, steps=steps)),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_steps(proc: subprocess.Popen, out: Path, name: str, n: int, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while True:
        rows = list(out.glob(f"{name}/*/metrics.jsonl"))
        if rows and sum(1 for x in rows[0].read_text().splitlines() if '"loss"' in x) >= n:
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise Drill(
                f"the run ended or stalled before step {n}: {proc.stdout.read()[-600:] if proc.stdout else ''}"
            )
        time.sleep(0.2)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _actors(root: int) -> list[int]:
    out = []
    for pid in _descendants(root):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::ModuleWorker"):
                out.append(pid)
        except OSError:
            pass
    return sorted(out)


def _finish(proc: subprocess.Popen, timeout: float = 400) -> str:
    try:
        text, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return text


# ---- drills ---------------------------------------------------------------------------------
def drill_restart_after_actor_kill(ctx: Ctx) -> str:
    _, base = ctx.base()
    rng = random.Random(14)
    out = ctx.work / "restart"
    proc = _popen_train(out, "r", "train.max_restarts=1")
    kill_at = rng.randint(EVERY + 1, STEPS - 1)
    _wait_steps(proc, out, "r", kill_at)
    victims = _actors(proc.pid)
    expect(bool(victims), "no ray::ModuleWorker actor found")
    os.kill(rng.choice(victims), signal.SIGKILL)
    text = _finish(proc)
    clean(text)
    expect(proc.returncode == 0, f"rc={proc.returncode}, expected 0 after one restart", text)
    expect("restart 1" in text and "rank" in text, "the restart was not reported with module and rank", text)
    (run_dir,) = (out / "r").iterdir()
    got = losses(run_dir)
    expect(got == base, f"losses after the restart differ: {got} vs {base}")
    return f"killed an actor after step {kill_at}; restarted once; losses equal the uninterrupted run"


def drill_actor_kill_without_restarts(ctx: Ctx) -> str:
    out = ctx.work / "norestart"
    proc = _popen_train(out, "n", "train.max_restarts=0", steps=50)
    _wait_steps(proc, out, "n", EVERY + 1)
    victims = _actors(proc.pid)
    os.kill(victims[-1], signal.SIGKILL)
    text = _finish(proc)
    clean(text)
    expect(proc.returncode == 1, f"rc={proc.returncode}, expected 1 (runtime)", text)
    expect(
        "module '" in text and "rank" in text and "died" in text,
        "the failure does not name module/rank",
        text,
    )
    expect("step_0000" in text, "the failure does not name the last good checkpoint", text)
    return "exit 1 naming the dead module/rank and the last good checkpoint"


def _damage_and_resume(ctx: Ctx, tag: str, damage: Callable[[Path], str]) -> str:
    out, run_dir = ctx.copy_base(tag)
    newest = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    what = damage(newest)
    rc, text = run("checkpoint", "verify", str(newest))
    clean(text)
    expect(rc == 1 and "FAIL" in text, f"`dhp checkpoint verify` did not fail (rc={rc})", text)
    rc, text = run(*train_args(out, "base", "train.resume=auto"))
    clean(text)
    expect(rc == 0, f"resume=auto failed (rc={rc})", text)
    expect(f"skipped{newest}" in flat(text), "resume=auto did not name the skipped checkpoint", text)
    expect(f"step_{EVERY:06d}atstep{EVERY}" in flat(text), "did not resume the previous one", text)
    _, base = ctx.base()
    runs = sorted((out / "base").iterdir())
    got = losses(runs[-1])
    expect(got == {s: base[s] for s in got}, f"losses after the fallback differ: {got}")
    return f"{what}: verify fails, resume=auto skips it (named) and resumes step {EVERY} with equal losses"


def _first_shard(ckpt: Path) -> Path:
    return sorted(ckpt.glob("llm/*.distcp"))[0]


def drill_truncated_shard(ctx: Ctx) -> str:
    def damage(ckpt: Path) -> str:
        f = _first_shard(ckpt)
        os.truncate(f, f.stat().st_size // 2)
        return f"truncated {f.name}"

    return _damage_and_resume(ctx, "trunc", damage)


def drill_zeroed_4k_in_shard(ctx: Ctx) -> str:
    def damage(ckpt: Path) -> str:
        f = _first_shard(ckpt)
        with open(f, "r+b") as fh:
            fh.seek(f.stat().st_size // 3)
            fh.write(b"\0" * 4096)
        return f"4 KiB of zeroes inside {f.name}"

    return _damage_and_resume(ctx, "zero", damage)


def drill_deleted_meta(ctx: Ctx) -> str:
    def damage(ckpt: Path) -> str:
        (ckpt / "meta.json").unlink()
        return "deleted meta.json"

    return _damage_and_resume(ctx, "nometa", damage)


def drill_deleted_metadata_file(ctx: Ctx) -> str:
    def damage(ckpt: Path) -> str:
        (ckpt / "vision" / ".metadata").unlink()
        return "deleted vision/.metadata"

    return _damage_and_resume(ctx, "nodcpmeta", damage)


def drill_binary_meta_explicit_resume(ctx: Ctx) -> str:
    out, run_dir = ctx.copy_base("binmeta")
    ckpt = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    (ckpt / "meta.json").write_bytes(bytes(range(256)) * 4)
    rc, text = run(*train_args(out, "x", f"train.resume={ckpt}"))
    clean(text)
    expect(rc == 2 and "CheckpointError" in text, f"rc={rc}, expected a CheckpointError (2)", text)
    expect("meta.json" in text, "the message does not name meta.json", text)
    return "explicit resume of a binary meta.json: CheckpointError naming the file, exit 2"


def drill_stale_temp_removed(ctx: Ctx) -> str:
    out, run_dir = ctx.copy_base("stale")
    stale = run_dir / "checkpoints" / "step_000003.tmp-999999"
    stale.mkdir()
    (stale / "junk").write_text("x")
    rc, text = run(*train_args(out, "base", "train.resume=auto", steps=STEPS + 1))
    clean(text)
    expect(rc == 0, f"rc={rc}", text)
    expect(not stale.exists(), "the stale temp dir is still there")
    expect("stale" in text and stale.name in flat(text), "no message about the stale dir", text)
    return "a crashed save's temp dir is removed at start, with a message"


def _signal_run(
    ctx: Ctx, tag: str, sigs: list[int], gap: float
) -> tuple[subprocess.Popen, str, Path, list[int]]:
    out = ctx.work / tag
    proc = _popen_train(out, "s", steps=200)
    _wait_steps(proc, out, "s", EVERY + 1)
    seen = _descendants(proc.pid)
    for s in sigs:
        os.kill(proc.pid, s)
        time.sleep(gap)
    text = _finish(proc, timeout=180)
    return proc, text, out, seen


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.5)
    return [p for p in pids if _alive(p)]


def drill_sigterm(ctx: Ctx) -> str:
    proc, text, out, seen = _signal_run(ctx, "term", [signal.SIGTERM], 0)
    clean(text)
    expect(proc.returncode == 143, f"rc={proc.returncode}, expected 143", text)
    (run_dir,) = (out / "s").iterdir()
    ckpts = sorted((run_dir / "checkpoints").iterdir())
    newest = ckpts[-1]
    step = json.loads((newest / "meta.json").read_text())["step"]
    expect(step > EVERY, f"no checkpoint after the signal (newest {newest.name})")
    expect(not no_tmp(out), f"temp dirs left: {no_tmp(out)}")
    left = _gone_within(seen, 10)
    expect(not left, f"processes of the run alive 10 s after exit: {left}")
    return f"exit 143, checkpoint at step {step}, no temp dir, no process left after 10 s"


def drill_double_signal(ctx: Ctx) -> str:
    proc, text, out, seen = _signal_run(ctx, "double", [signal.SIGTERM, signal.SIGTERM], 0.05)
    clean(text)
    expect(proc.returncode in (130, 143), f"rc={proc.returncode}, expected 143", text)
    expect("checkpoint" in text, "does not say which checkpoint is the last good one", text)
    expect(not no_tmp(out), f"temp dirs left: {no_tmp(out)}")
    left = _gone_within(seen, 10)
    expect(not left, f"processes of the run alive 10 s after exit: {left}")
    return f"two signals: rc {proc.returncode}, last good checkpoint named, no temp dir, no process left"


def drill_unwritable_output_dir(ctx: Ctx) -> str:
    f = ctx.work / "a_file"
    f.write_text("not a dir")
    rc, text = run(*train_args(f / "sub", "u"))
    clean(text)
    expect(
        rc == 2 and "train.output_dir" in text,
        f"rc={rc}, expected a ConfigError naming train.output_dir",
        text,
    )
    return "output_dir under a file: ConfigError naming train.output_dir, exit 2"


def drill_enospc_at_save(ctx: Ctx) -> str:
    mnt = ctx.work / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        raise Drill(f"could not mount a small tmpfs to fill ({r.stderr.strip()}); drill not run")
    try:
        rc, text = run(*train_args(mnt, "full", "train.keep_last=5", steps=12))
        clean(text)
        expect(rc == 1, f"rc={rc}, expected 1", text)
        expect(
            "previouscheckpointiskept" in flat(text),
            "the message does not name the kept checkpoint",
            text,
        )
        expect(not no_tmp(mnt), f"temp dirs left: {no_tmp(mnt)}")
        (run_dir,) = (mnt / "full").iterdir()
        ok = [p for p in (run_dir / "checkpoints").iterdir() if (p / "meta.json").is_file()]
        expect(bool(ok), "no complete checkpoint survived")
        rc, vtext = run("checkpoint", "verify", str(sorted(ok)[-1]))
        expect(rc == 0, "the kept checkpoint does not verify", vtext)
        return f"disk full at save: exit 1, temp dir removed, {sorted(ok)[-1].name} kept and verifies"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def drill_same_second_run_dirs(ctx: Ctx) -> str:
    sys.path.insert(0, str(ROOT))
    from dhp.runtime.loop.train import make_run_dir

    dirs = {make_run_dir(output_dir=str(ctx.work / "same"), name="n") for _ in range(3)}
    expect(len(dirs) == 3, f"run dirs collide: {dirs}")
    return "three run dirs of one name in one second are distinct"


def _config_refused(*override: str, key: str) -> str:
    rc, text = run("plan", "conf=tiny_vlm", "--dry-run", *override)
    clean(text)
    expect(
        rc == 2 and "ConfigError" in text and key in text,
        f"{override}: rc={rc}, expected ConfigError on {key}",
        text,
    )
    return f"{' '.join(override)} refused naming {key}"


def drill_config_guards(ctx: Ctx) -> str:
    done = [
        _config_refused("train.lr=inf", key="train.lr"),
        _config_refused("train.lr=nan", key="train.lr"),
        _config_refused("train.lr=0", key="train.lr"),
        _config_refused("train.step_timeout_s=0", key="train.step_timeout_s"),
        _config_refused("train.steps=-1", key="train.steps"),
        _config_refused("name=../../escape", key="name"),
        _config_refused("+modules.audio.gpus=1", key="known"),
        _config_refused("checkpoint.async_save=maybe", key="checkpoint.async_save"),
        _config_refused("train.restart_wait_s=inf", key="train.restart_wait_s"),
    ]
    return "; ".join(done)


def drill_model_type_mismatch(ctx: Ctx) -> str:
    d = ctx.work / "fake_model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return _config_refused(f"model.path={d}", key="model_type")


def drill_foreign_local_ray_head(ctx: Ctx) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="rayhead", dir="/tmp"))
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", "--num-cpus=1", f"--temp-dir={tmp}", "--port=0"]
        if shutil.which("ray")
        else [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--num-cpus=1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=env(),
    )
    try:
        time.sleep(15)
        rc, text = run(*train_args(ctx.work / "foreign", "f", "train.warmup_steps=0", steps=1))
        clean(text)
        expect(rc == 0, f"rc={rc}: the run did not start its own local Ray", text)
        return "a `ray start` head on this machine is not joined without an address; the run trains"
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def drill_driver_sigkill_async_save(ctx: Ctx) -> str:
    """checkpoint.async_save: SIGKILL the driver at a seeded moment right after a save was issued
    (it is in flight or just committed). The run's Ray processes must be gone within 10 s, and
    resume=auto must continue from a checkpoint that verifies, with the uninterrupted losses."""
    _, base = ctx.base()
    rng = random.Random(1414)
    out = ctx.work / "asynckill"
    proc = _popen_train(out, "a", "checkpoint.async_save=true")
    _wait_steps(proc, out, "a", EVERY)  # the step-EVERY save is issued at this boundary
    time.sleep(rng.uniform(0.0, 0.3))
    expect(proc.poll() is None, "the run ended before the kill: the drill proves nothing")
    seen = _descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = _gone_within(seen, 10)
    expect(not left, f"{len(left)} process(es) of the killed driver alive after 10 s: {_cmdlines(left)}")
    (run_dir,) = (out / "a").iterdir()
    committed = sorted(p.name for p in (run_dir / "checkpoints").glob("step_??????"))
    rc, text = run(*train_args(out, "a", "checkpoint.async_save=true", "train.resume=auto"))
    clean(text)
    expect(rc == 0, f"resume=auto after the kill failed (rc={rc})", text)
    expect(not no_tmp(out), f"temp dirs left: {no_tmp(out)}")
    runs = sorted((out / "a").iterdir())
    got = losses(runs[-1])
    expect(got == {s: base[s] for s in got}, f"losses after the resume differ: {got} vs {base}")
    for ck in (runs[-1] / "checkpoints").iterdir():
        rc, vtext = run("checkpoint", "verify", str(ck))
        expect(rc == 0, f"{ck.name} of the resumed run does not verify", vtext)
    return (
        f"driver SIGKILLed after step {EVERY} with an async save issued ({len(seen)} processes gone "
        f"within 10 s); committed before the kill: {committed or 'none'}; resume=auto continued "
        f"{'from ' + committed[-1] if committed else 'from step 0'} with equal losses"
    )


def _cmdlines(pids: list[int]) -> list[str]:
    out = []
    for p in pids:
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:120].decode()
            out.append(f"{p}: {cmd}")
        except OSError:
            out.append(f"{p}: ?")
    return out


def drill_sigterm_during_startup(ctx: Ctx) -> str:
    """SIGTERM while the actors are still starting (before step 1): exit 143, nothing half-written,
    no process left."""
    out = ctx.work / "earlyterm"
    proc = _popen_train(out, "e")
    deadline = time.monotonic() + 120
    while not list(out.glob("e/*/plan.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    expect(proc.poll() is None, "the run ended before it could be signalled")
    time.sleep(random.Random(7).uniform(0.5, 3.0))  # somewhere in Ray start / actor build
    seen = _descendants(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    text = _finish(proc, timeout=180)
    clean(text)
    expect(proc.returncode == 143, f"rc={proc.returncode}, expected 143", text)
    expect(not no_tmp(out), f"temp dirs left: {no_tmp(out)}")
    left = _gone_within(seen, 10)
    expect(not left, f"processes of the run alive 10 s after exit: {left}")
    return "SIGTERM before the first step: exit 143, no temp dir, no process left after 10 s"


def drill_corrupt_manifest(ctx: Ctx) -> str:
    def damage(ckpt: Path) -> str:
        (ckpt / "manifest.json").write_bytes(b"\xff\xfe{not json")
        return "a garbled manifest.json"

    return _damage_and_resume(ctx, "badmanifest", damage)


def drill_corrupt_rank_rng_file(ctx: Ctx) -> str:
    def damage(ckpt: Path) -> str:
        f = sorted(ckpt.glob("llm/extra/rank_*.pt"))[0]
        f.write_bytes(f.read_bytes()[:-7] + b"garbage")
        return f"the last bytes of {f.relative_to(ckpt)} overwritten (same size)"

    return _damage_and_resume(ctx, "badrng", damage)


DRILLS: dict[str, Callable[[Ctx], str]] = {
    "restart_after_actor_kill": drill_restart_after_actor_kill,
    "actor_kill_without_restarts": drill_actor_kill_without_restarts,
    "truncated_shard": drill_truncated_shard,
    "zeroed_4k_in_shard": drill_zeroed_4k_in_shard,
    "deleted_meta_json": drill_deleted_meta,
    "deleted_dcp_metadata": drill_deleted_metadata_file,
    "binary_meta_json": drill_binary_meta_explicit_resume,
    "stale_temp_dir": drill_stale_temp_removed,
    "sigterm": drill_sigterm,
    "double_signal": drill_double_signal,
    "unwritable_output_dir": drill_unwritable_output_dir,
    "enospc_at_save": drill_enospc_at_save,
    "same_second_run_dirs": drill_same_second_run_dirs,
    "config_guards": drill_config_guards,
    "model_type_mismatch": drill_model_type_mismatch,
    "foreign_local_ray_head": drill_foreign_local_ray_head,
    "driver_sigkill_async_save": drill_driver_sigkill_async_save,
    "sigterm_during_startup": drill_sigterm_during_startup,
    "corrupt_manifest": drill_corrupt_manifest,
    "corrupt_rank_rng_file": drill_corrupt_rank_rng_file,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fault_drills.json")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--work", default=None, help="working directory (default: a temp dir, removed)")
    args = ap.parse_args()
    if args.list:
        print("\n".join(DRILLS))
        return 0
    names = args.only or list(DRILLS)
    unknown = [n for n in names if n not in DRILLS]
    if unknown:
        print(f"unknown drill(s) {unknown}; known: {', '.join(DRILLS)}", file=sys.stderr)
        return 2
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="dhp-drills-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(work)
    results = []
    for name in names:
        t0 = time.monotonic()
        try:
            detail, passed = DRILLS[name](ctx), True
        except Drill as e:
            detail, passed = str(e), False
        except Exception as e:  # a drill's own bug is a failed drill, not a crashed battery
            detail, passed = f"{type(e).__name__}: {e}", False
        results.append(
            {"name": name, "passed": passed, "detail": detail, "seconds": round(time.monotonic() - t0, 1)}
        )
        print(
            f"{'PASS' if passed else 'FAIL'}  {name:30s} {results[-1]['seconds']:6.1f}s  {detail[:160]}",
            flush=True,
        )
    Path(args.out).write_text(json.dumps({"drills": results}, indent=1))
    width = max(len(r["name"]) for r in results)
    print("\n" + "drill".ljust(width) + "  result")
    for r in results:
        print(r["name"].ljust(width) + ("  pass" if r["passed"] else "  FAIL"))
    print(f"{sum(r['passed'] for r in results)}/{len(results)} passed; wrote {args.out}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
