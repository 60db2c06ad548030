"""The rank fork server (dhp.runtime.launch.forkserver) and its launcher (dhp.runtime.launch.forklaunch), without Ray.

Each test runs the launcher exactly as Ray's worker start runs it (``python -S forklaunch.py SOCKET
SCRIPT ARGS...``) on a real server process, with a small script in place of Ray's default_worker.py.
Servers preload only the standard library (``json``) except where a test needs torch: what is
tested is the process hand-over, not the imports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dhp.runtime.launch import forkserver
from dhp.runtime.launch.forklaunch import MISS_ENV
from dhp.runtime.launch.forkserver import FORKED_ENV, ForkServer

pytestmark = pytest.mark.skipif(not forkserver.enabled(), reason="fork server: Linux with fork only")

REPORT = """
import json, os, random, sys
out = {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "cwd": os.getcwd(),
       "forked": os.environ.get("DHP_FORKED_FROM"), "miss": os.environ.get("DHP_FORK_SERVER_MISS"),
       "mark": os.environ.get("MARK"), "random": random.random(), "preloaded": sorted(
           m for m in ("json", "torch", "ray._raylet") if m in sys.modules)}
print(json.dumps(out))
sys.exit(int(os.environ.get("EXIT", "0")))
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fork") / "report.py"
    path.write_text(REPORT)
    return path


@pytest.fixture
def server():
    srv = ForkServer.start(preload=("json",))
    assert srv.request({"op": "status"})["loaded"] == ["json"]  # up and preloaded
    yield srv
    srv.close()


def launch(srv_or_path, *args: str, env: dict | None = None, cwd: str | None = None, **kw):
    path = srv_or_path.path if isinstance(srv_or_path, ForkServer) else srv_or_path
    cmd = [sys.executable, "-S", str(Path(forkserver.__file__).with_name("forklaunch.py")), path, *args]
    return subprocess.run(
        cmd, env={**os.environ, **(env or {})}, cwd=cwd, capture_output=True, text=True, timeout=60, **kw
    )


def test_a_launched_worker_runs_in_a_child_of_the_server_with_the_launchers_argv_env_cwd_and_status(
    server, script, tmp_path
):
    done = launch(server, str(script), "--x=1", env={"MARK": "m1", "EXIT": "7"}, cwd=str(tmp_path))
    assert done.returncode == 7, done.stderr  # the child's exit status comes back through the launcher
    out = json.loads(done.stdout)  # written to the launcher's stdout: its descriptors were handed over
    assert out["ppid"] == server.proc.pid and out["forked"] == str(server.proc.pid)
    assert out["argv"] == [str(script), "--x=1"]
    assert out["cwd"] == str(tmp_path) and out["mark"] == "m1" and out["miss"] is None
    assert out["preloaded"] == ["json"]  # imported by the server before the fork, never by the child


def test_children_get_their_own_python_random_state(server, script):
    a, b = (json.loads(launch(server, str(script)).stdout)["random"] for _ in range(2))
    assert a != b  # a forked child reseeds; without it both would draw the server's next number


def test_a_killed_launcher_takes_its_child_with_it(server, tmp_path):
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n")
    launcher = Path(forkserver.__file__).with_name("forklaunch.py")
    proc = subprocess.Popen(
        [sys.executable, "-S", str(launcher), server.path, str(sleeper)], stdout=subprocess.PIPE, text=True
    )
    child = int(proc.stdout.readline())
    assert child != proc.pid
    proc.kill()  # what Ray does to the process it started, if it kills that one
    proc.wait()
    assert _gone(child), "the server did not kill the child of a dead launcher"


def test_a_signal_to_the_launcher_reaches_the_child_and_its_status_comes_back(server, tmp_path):
    waiter = tmp_path / "wait_term.py"
    waiter.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))\n"
        "print(os.getpid(), flush=True)\ntime.sleep(60)\n"
    )
    launcher = Path(forkserver.__file__).with_name("forklaunch.py")
    proc = subprocess.Popen(
        [sys.executable, "-S", str(launcher), server.path, str(waiter)], stdout=subprocess.PIPE, text=True
    )
    int(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 42  # the child's own SIGTERM handler ran


def test_a_child_killed_by_a_signal_exits_the_launcher_with_128_plus_it(server, tmp_path):
    killer = tmp_path / "die.py"
    killer.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert launch(server, str(killer)).returncode == 128 + signal.SIGKILL


@pytest.mark.slow
def test_without_a_server_the_launcher_starts_the_worker_itself_and_says_why(script, tmp_path):
    done = launch(str(tmp_path / "none.sock"), str(script), env={"MARK": "m2"})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["forked"] is None and out["mark"] == "m2"
    assert "cannot reach it" in out["miss"] and "none.sock" in out["miss"]
    assert "starts without the fork server" in done.stderr  # on the rank's own log


def test_a_server_that_loaded_ray_refuses_to_fork(script):
    """Ray's core reads the job id and the raylet's pid from the environment once, when it loads: a
    child of a server that loaded it would register under the server's (empty) ones."""
    srv = ForkServer.start(preload=("ray",))
    try:
        assert "Ray is loaded" in srv.request({"op": "status"})["refusal"]
        done = launch(srv, str(script))
        out = json.loads(done.stdout)
        assert done.returncode == 0 and out["forked"] is None and "Ray is loaded" in out["miss"]
    finally:
        srv.close()


@pytest.mark.slow
def test_the_base_preload_holds_torch_and_never_ray(script):
    srv = ForkServer.start()  # BASE_PRELOAD: torch and dhp's rank code
    try:
        status = srv.request({"op": "status"})
        assert status["failed"] == {} and status["refusal"] is None, status
        assert list(forkserver.BASE_PRELOAD) == status["loaded"]
        out = json.loads(launch(srv, str(script)).stdout)
        assert out["forked"] == str(srv.proc.pid) and "torch" in out["preloaded"]
        assert "ray._raylet" not in out["preloaded"]
    finally:
        srv.close()


@pytest.mark.slow
def test_a_run_asks_the_serving_server_for_its_family_and_only_a_serving_one():
    srv = ForkServer.start(preload=("json",))
    try:
        forkserver.preload_family("qwen3_vl")  # not serving a local Ray (yet): left alone
        assert srv.request({"op": "status"})["loaded"] == ["json"]
        srv.serving = True
        forkserver.preload_family("qwen3_vl")
        status = srv.request({"op": "status"})  # answered once the preload before it is done
        assert status["loaded"] == ["json", *forkserver.family_modules("qwen3_vl")], status
        assert status["failed"] == {} and status["refusal"] is None, status
    finally:
        srv.close()


def test_a_dead_servers_folder_is_removed_by_close_current():
    srv = ForkServer.start(preload=())
    srv.request({"op": "status"})
    os.kill(srv.proc.pid, signal.SIGKILL)  # nothing of its own clean-up runs
    srv.proc.wait(timeout=10)
    assert forkserver.current() is None and os.path.exists(srv.path)
    forkserver.close_current()
    assert not os.path.exists(os.path.dirname(srv.path))


def test_the_server_ends_when_its_driver_does(tmp_path):
    code = (
        "import sys, time\nfrom dhp.runtime.launch.forkserver import ForkServer\n"
        "s = ForkServer.start(preload=())\nprint(s.proc.pid, flush=True)\n"
        "s.request({'op': 'status'})\nimport os\nos._exit(0)\n"  # no close(): a driver that died
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert _gone(int(out.stdout.split()[0])), "the fork server outlived its driver"


def test_close_stops_the_server_and_removes_its_socket():
    srv = ForkServer.start(preload=())
    srv.request({"op": "status"})
    path = srv.path
    srv.close()
    assert not srv.alive() and not os.path.exists(path) and forkserver.current() is None


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_forked_env_names_match_the_worker_side():
    assert FORKED_ENV == "DHP_FORKED_FROM" and MISS_ENV == "DHP_FORK_SERVER_MISS"


def test_a_launcher_gone_before_its_answer_leaves_the_server_serving(server, script, tmp_path):
    """A launcher killed between its request and the answer (Ray stopping a starting worker): the
    server kills the orphan child and keeps serving the next ones."""
    import socket

    from dhp.runtime.launch.forklaunch import send_msg

    marker = tmp_path / "started"
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text(
        f"import pathlib, time\npathlib.Path({str(marker)!r}).write_text('x')\ntime.sleep(60)\n"
    )
    for _ in range(3):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(server.path)
            request = {"op": "spawn", "argv": [str(sleeper)], "env": dict(os.environ), "cwd": str(tmp_path)}
            send_msg(sock, request, fds=[0, 1, 2])
        # closed without reading the answer
    status = server.request({"op": "status"})
    assert status.get("refusal", "dead") is None and server.alive(), status
    out = json.loads(launch(server, str(script)).stdout)
    assert out["forked"] == str(server.proc.pid)  # the next rank is still forked


def test_close_ends_the_children_still_running(tmp_path):
    """After Ray's shutdown, a forked rank left running (Ray stopped only the launcher it started)
    ends with the server instead of lingering as an orphan."""
    srv = ForkServer.start(preload=())
    srv.request({"op": "status"})  # up
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text(
        "import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n"
    )
    launcher = Path(forkserver.__file__).with_name("forklaunch.py")
    proc = subprocess.Popen(
        [sys.executable, "-S", str(launcher), srv.path, str(sleeper)], stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(proc.stdout.readline())
        assert int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1]) == srv.proc.pid
        srv.close()
        assert _gone(child, within_s=5), "a child outlived its fork server"  # SIGTERM ignored: SIGKILL
    finally:
        proc.kill()
        proc.wait()
        srv.close()


def test_a_driver_joining_a_cluster_starts_no_server_of_its_own(monkeypatch):
    """Its ranks run on the cluster's nodes, which start their own (dhp.runtime.launch.forknodes)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert forkserver.start_for_driver("qwen2_5_vl", ray_address="10.0.0.1:6379") is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert forkserver.start_for_driver("qwen2_5_vl") is None
    assert forkserver.current() is None
