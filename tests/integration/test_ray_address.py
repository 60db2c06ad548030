"""Joining an existing Ray cluster ($RAY_ADDRESS / cluster.ray_address) instead of starting one.

A real head node runs for this module: ``ray start --head --block`` in its own session, with token
authentication on (Ray 2.60's default for a new cluster, kept), its own token file, temp dir and
ports. A driver joining by explicit address gets the token only from the environment:
``RAY_AUTH_MODE=token`` plus ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH`` (or ~/.ray/auth_token).

- ``dhp train`` joined through ``$RAY_ADDRESS`` finishes and writes metrics.jsonl; the head's job
  table then holds it as a finished job whose driver was that process (it ran *there*, not on a
  Ray of its own), and the cluster is left as found: head up, every CPU free, every placement
  group removed (``Trainer.close()``'s ``ray.shutdown()`` only disconnects a joined driver);
- ``dhp train`` without ``RAY_AUTH_MODE=token`` (run alongside) is refused by the cluster and exits
  with dhp's PlanError (status 2) naming the fix, not a traceback;
- a Trainer joined through ``cluster.ray_address`` (no ``$RAY_ADDRESS``) whose plan asks for more
  CPUs than the cluster has raises PlanError after its reservation timeout, not a hang;
- ``ray job submit -- python -m dhp.cli train ... train.steps=2`` through the head's job server
  (the dashboard, on 127.0.0.1 at a free port) runs dhp as a Ray job to the end.

Teardown stops only this head (SIGTERM to its ``ray start --block``, then its leftover
descendants by pid); never ``ray stop``, which would stop every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from plans import ALL_ONE
from procs import alive, descendants

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")
HEAD_CPUS = 4
AUTH_VARS = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")

# Joins through cluster.ray_address (argv overrides; no $RAY_ADDRESS), reports what the cluster
# holds, disconnects, then builds a Trainer whose one-rank bundles need 8 CPUs each (the head has 4).
JOIN_SCRIPT = """
import json, sys, time
import ray
import ray._private.state as state
from dhp.validation import load_config
from dhp.errors import PlanError
from dhp.plan import compile_plan
from dhp.runtime import Trainer

cfg = load_config("tiny_vlm", sys.argv[1:])
plan = compile_plan(cfg)
ray.init(address=cfg.cluster.ray_address, log_to_driver=False)
out = {
    "jobs": state.jobs(),
    "available_cpu": ray.available_resources().get("CPU", 0.0),
    "total_cpu": ray.cluster_resources().get("CPU", 0.0),
    "placement_groups": [pg["state"] for pg in ray.util.placement_group_table().values()],
}
ray.shutdown()
t0 = time.monotonic()
try:
    Trainer(cfg, plan, ready_timeout_s=5).close()
except PlanError as e:
    out |= {"error": "PlanError", "message": str(e)}
out |= {"seconds": time.monotonic() - t0, "ray_initialized_after": ray.is_initialized()}
print("RESULT " + json.dumps(out, default=str))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Head:
    """A running head node: its ``ray start`` process, GCS address and token file."""

    proc: subprocess.Popen
    address: str
    token_path: Path
    dashboard: str  # the job server, http://127.0.0.1:PORT

    def env(self, *, address: bool = True, auth: bool = True) -> dict[str, str]:
        """This test's environment for a driver: Ray's address/auth variables only as asked."""
        env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS}
        env["PYTHONUNBUFFERED"] = "1"
        if address:
            env["RAY_ADDRESS"] = self.address
        if auth:
            env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}
        return env


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    tmp = Path(tempfile.mkdtemp(prefix="dhp-rh-", dir="/tmp"))  # short: Ray's unix socket paths
    token_path = tmp / "auth_token"
    token_path.write_text(os.urandom(32).hex())
    port, dash = _free_port(), _free_port()
    cmd = [str(RAY), "start", "--head", f"--num-cpus={HEAD_CPUS}", f"--port={port}", "--block"]
    cmd += ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}"]
    cmd += ["--disable-usage-stats", f"--temp-dir={tmp / 'ray'}"]
    cmd += [f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}"]
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS}
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
    log = (tmp / "head.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in (tmp / "head.log").read_text():
            assert proc.poll() is None, (
                f"ray start exited {proc.returncode}:\n{(tmp / 'head.log').read_text()}"
            )
            assert time.monotonic() < deadline, (tmp / "head.log").read_text()
            time.sleep(0.25)
        yield Head(
            proc=proc,
            address=f"127.0.0.1:{port}",
            token_path=token_path,
            dashboard=f"http://127.0.0.1:{dash}",
        )
    finally:
        family = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        deadline = time.monotonic() + 10
        while (left := [p for p in family if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in left:  # only this head's own processes, by pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _result(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert lines, out[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def _dhp_train(out_dir: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dhp.cli", "train", "conf=tiny_vlm", "name=joined", "smoke=true"]
    cmd += ["train.steps=1", f"train.output_dir={out_dir}", *ALL_ONE]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_dhp_joins_an_existing_cluster_and_leaves_it_running(head: Head, tmp_path: Path):
    train = _dhp_train(tmp_path / "ok", head.env())
    # Ray retries a refused join for ~20 s; its own knob cuts that to 2 attempts for this driver
    no_token = _dhp_train(
        tmp_path / "no_token", head.env(auth=False) | {"RAY_gcs_server_port_wait_time_s": "2"}
    )
    outs = {}
    try:
        for name, p in (("no_token", no_token), ("train", train)):
            outs[name] = p.communicate(timeout=300)[0]
    finally:
        for p in (train, no_token):
            if p.poll() is None:
                p.kill()
                p.wait()

    # joined through $RAY_ADDRESS, trained, wrote its metrics
    assert train.returncode == 0, outs["train"][-4000:]
    assert "Connecting to existing Ray cluster" in outs["train"], outs["train"][-4000:]
    assert "Started a local Ray instance" not in outs["train"]
    (metrics,) = (tmp_path / "ok" / "joined").glob("*/metrics.jsonl")
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    assert rows and all("loss" in r for r in rows)

    # no RAY_AUTH_MODE=token: the cluster refuses the driver; dhp says why and how to fix it
    assert no_token.returncode == 2, outs["no_token"][-4000:]
    text = " ".join(outs["no_token"].split())  # the CLI wraps the message in a panel
    assert "cannot join the Ray cluster" in text and "RAY_AUTH_MODE=token" in text, text[-3000:]
    assert "Traceback" not in outs["no_token"], outs["no_token"][-4000:]

    # the head is still up and shows the dhp run as a finished job of its own, resources all free
    assert head.proc.poll() is None, "dhp shut down a Ray cluster it did not start"
    overrides = [*ALL_ONE, f"cluster.ray_address={head.address}", "cluster.cpus_per_rank=8"]
    join = subprocess.run(
        [sys.executable, "-c", JOIN_SCRIPT, *overrides],
        cwd=ROOT,
        env=head.env(address=False),
        capture_output=True,
        text=True,
        timeout=300,
    )
    res = _result(join.stdout + join.stderr)
    jobs = {j["DriverPid"]: j for j in res["jobs"]}
    assert train.pid in jobs, f"dhp train (pid {train.pid}) never joined this cluster: {res['jobs']}"
    assert jobs[train.pid]["IsDead"] is True and "dhp.cli train" in jobs[train.pid]["Entrypoint"]
    assert no_token.pid not in jobs
    assert res["total_cpu"] == HEAD_CPUS and res["available_cpu"] == HEAD_CPUS, res
    assert res["placement_groups"] and all(s == "REMOVED" for s in res["placement_groups"]), res

    # cluster.ray_address, a plan the cluster cannot hold: PlanError after the timeout, no hang
    assert res.get("error") == "PlanError", res
    assert "cannot place the plan" in res["message"] and f"'CPU': {float(HEAD_CPUS)}" in res["message"], res
    assert 5 <= res["seconds"] < 60 and not res["ray_initialized_after"], res
    assert head.proc.poll() is None


def test_ray_job_submit_runs_dhp_train(head: Head, tmp_path: Path):
    """``ray job submit`` to the head's job server: a 2-step ``dhp train`` runs as the job's
    entrypoint (its driver joins this cluster by itself) and succeeds."""
    out = tmp_path / "job"
    entry = [sys.executable, "-m", "dhp.cli", "train", "conf=tiny_vlm", "name=job", "train.steps=2"]
    entry += [f"train.output_dir={out}", *ALL_ONE]
    env = head.env(address=False) | {"RAY_ADDRESS": head.dashboard, "PYTHONPATH": str(ROOT)}
    runtime_env = json.dumps({"env_vars": {"PYTHONPATH": str(ROOT)}})
    proc = subprocess.run(
        [str(RAY), "job", "submit", "--runtime-env-json", runtime_env, "--", *entry],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "succeeded" in text, text[-4000:]
    assert "dhp train summary" in text, text[-4000:]  # the job's logs are dhp's console
    (metrics,) = (out / "job").glob("*/metrics.jsonl")
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2]
    assert head.proc.poll() is None
