"""A joined cluster's per-node fork servers (dhp.runtime.launch.forknodes), without Ray.

The actor class that holds a node's server runs here as a plain object, spawning a real server
(preloading only ``json``: what is tested is who starts what, not the imports); the launcher command
it answers is run exactly as Ray would run it. The driver's mapping of bundles to their nodes'
launchers is checked on its own. tests/integration/test_multinode.py runs the real thing on a
two-node Ray cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from dhp.runtime.launch import forkserver
from dhp.runtime.launch.forklaunch import MISS_ENV
from dhp.runtime.launch.forknodes import ForkServerHost, NodeForkServers, NodeServer
from dhp.runtime.launch.forkserver import PACKAGE_ROOT

pytestmark = pytest.mark.skipif(not forkserver.enabled(), reason="fork server: Linux with fork only")

REPORT = "import json, os\nprint(json.dumps({'ppid': os.getppid(), 'miss': os.environ.get('DHP_FORK_SERVER_MISS')}))\n"


def _start(host: ForkServerHost, **kw) -> dict:
    args = {"python": sys.executable, "root": PACKAGE_ROOT, "preload": ["json"], "timeout_s": 60.0}
    return host.start(**{**args, **kw})


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ({"python": "/opt/elsewhere/bin/python"}, "its Python is"),
        ({"root": "/srv/other-checkout"}, "no shared path"),
    ],
)
def test_a_node_without_the_drivers_python_or_dhp_path_refuses_and_starts_nothing(given, why):
    host = ForkServerHost()
    reply = _start(host, **given)
    assert why in reply["error"] and host.server is None, reply


def test_a_node_with_the_fork_server_off_refuses(monkeypatch):
    monkeypatch.setenv(forkserver.ENABLE_ENV, "0")
    reply = _start(ForkServerHost())
    assert "off there" in reply["error"], reply


def test_each_nodes_host_runs_a_server_of_its_own_that_forks_its_ranks(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    hosts = [ForkServerHost(), ForkServerHost()]  # two nodes on one machine
    try:
        replies = [_start(h) for h in hosts]
        assert all("error" not in r for r in replies), replies
        sockets = [r["py_executable"].split()[-1] for r in replies]
        assert len(set(sockets)) == 2  # a socket (and folder) per node
        assert forkserver.current() is None  # a node's server is not the driver's own
        for host, reply in zip(hosts, replies, strict=True):
            cmd = [*reply["py_executable"].split(), str(script)]  # what Ray runs for a rank
            out = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout)
            assert out == {"ppid": reply["pid"], "miss": None}  # forked from this node's server
            assert host.status()["loaded"] == ["json"]
    finally:
        for h in hosts:
            h.close()
    assert all(h.server is None for h in hosts)
    assert not any(Path(s).parent.exists() for s in sockets)  # close() removes each socket folder
    assert "no fork server" in hosts[0].status()["error"]


class _PG:
    """The one thing the mapping reads of a placement group: its id's hex."""

    def __init__(self, hex_id: str) -> None:
        self.id = type("Id", (), {"hex": lambda _self: hex_id})()


def test_each_rank_gets_its_nodes_launcher_or_why_its_node_cannot_serve():
    pg_a, pg_b = _PG("aa"), _PG("bb")
    servers = {
        "n1": NodeServer(
            "10.0.0.1 (n1)", py_executable="python -S forklaunch.py /tmp/dhp-fork-1/server.sock"
        ),
        "n2": NodeServer("10.0.0.2 (n2)", miss="its Python is /x/python, the driver's is /y/python"),
    }
    nodes = NodeForkServers(servers, hosts={}, bundles={("aa", 0): "n1", ("aa", 1): "n1", ("bb", 0): "n2"})
    assert nodes.runtime_env(pg_a, 1) == {"py_executable": servers["n1"].py_executable}
    assert nodes.runtime_env(pg_b, 0) == {
        "env_vars": {MISS_ENV: "on node 10.0.0.2 (n2): its Python is /x/python, the driver's is /y/python"}
    }
    assert "not among the reserved" in nodes.runtime_env(pg_b, 1)["env_vars"][MISS_ENV]
    nodes.close()  # no actor to stop: nothing to do, and no Ray started for it
    assert not ray.is_initialized()


def test_a_server_whose_parent_died_removes_its_socket_folder():
    code = (
        "from dhp.runtime.launch.forkserver import ForkServer\n"
        "s = ForkServer.spawn(env={}, preload=())\nprint(s.proc.pid, s.path, flush=True)\n"
        "s.request({'op': 'status'})\nimport os\nos._exit(0)\n"  # no close(): a node's actor killed
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    path = out.stdout.split()[1]  # the server ends with its parent: test_forkserver.py
    deadline = time.monotonic() + 10
    while os.path.exists(os.path.dirname(path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(os.path.dirname(path)), "the server left its socket folder behind"
