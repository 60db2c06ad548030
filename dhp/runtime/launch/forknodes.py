"""One pre-imported fork server per node of a joined Ray cluster, for the life of one run.

A local Ray instance's ranks fork from the driver's own server (:mod:`dhp.runtime.launch.forkserver`). When
the driver joins a cluster instead (``cluster.ray_address``, ``$RAY_ADDRESS``, or a Ray this process
had already connected), its ranks run on other nodes, so each node that the plan's placement groups
reserved gets a server of its own. Once the groups are reserved, :meth:`NodeForkServers.start` puts
one small actor on each of those nodes (``num_cpus=0``, pinned by ``NodeAffinitySchedulingStrategy``,
outside the placement groups). The actor spawns a server there with the ranks' import environment,
preloading what the driver's server preloads (``BASE_PRELOAD`` and the family's modules) under that
node's Python, and answers once the server listens (its imports run on, beside the ranks' start).
Each rank's actor then carries the ``py_executable`` of the server on its bundle's node
(``ray.util.placement_group_table``). A server's socket lives in a folder made on its own node, so
two nodes on one machine (a simulated cluster) never share one.

A shared filesystem is assumed: the node must run the driver's Python (the same ``sys.executable``)
and find dhp at the driver's path (the launcher's path is the driver's). Where a node cannot serve
(another Python or dhp path, the server off or no fork there, its actor failing or not answering
in time, the server exiting before it listens), that node's ranks start the ordinary way with
``DHP_FORK_SERVER_MISS`` naming the node and the reason: ``DistWorker.started`` reports ``fresh:
REASON`` and the start-up line names it. ``DHP_FORK_SERVER=0`` on the driver starts none.

Lifetime: :meth:`NodeForkServers.close` runs after the ranks' actors are killed and before Ray's
shutdown. It stops each server, which ends any rank process still running (SIGTERM, SIGKILL a second
later), removes its socket folder, and kills its actor. A driver that dies takes them too: its job's
actors die with it, and a server exits (ending its children) once its parent, the actor, is gone.

Memory: per node, one server (about 0.5 GB resident with torch and transformers; forked ranks share
its pages) and one idle actor process (Ray's core worker, about 100 MB). This module is what that
actor process imports: Ray and the standard library, never torch.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dhp.runtime.launch import forkserver
from dhp.runtime.launch.devices import NOSET_VISIBLE
from dhp.runtime.launch.forklaunch import MISS_ENV
from dhp.runtime.launch.forkserver import BASE_PRELOAD, ENABLE_ENV, IMPORT_ENV, PACKAGE_ROOT, ForkServer

#: every rank actor's environment (NOSET_VISIBLE: each sees all GPUs of its node, dhp.runtime.launch.devices),
#: and so that of the actor holding a node's server and of the server's imports
WORKER_ENV = {**IMPORT_ENV, **NOSET_VISIBLE}


@dataclass(frozen=True)
class NodeServer:
    """One node's server as the driver sees it: the launcher command its ranks run, or why none."""

    node: str  # the node's IP and short id, as the start-up line names it
    py_executable: str | None = None  # None: this node's ranks start the ordinary way
    miss: str | None = None  # why not
    pid: int | None = None  # the server's pid on that node


def node_refusal(*, python: str, root: str) -> str | None:
    """Why this node cannot run a server for a driver running ``python`` with dhp at ``root``, or None."""
    if not forkserver.enabled():
        return f"the fork server is off there ({ENABLE_ENV}=0, or no fork on {sys.platform})"
    if os.path.abspath(sys.executable) != os.path.abspath(python):
        return f"its Python is {sys.executable}, the driver's is {python}"
    if root != PACKAGE_ROOT:
        return f"dhp there is under {PACKAGE_ROOT}, the driver's under {root} (no shared path)"
    return None


class ForkServerHost:
    """The actor holding one node's server (``ray.remote`` at use). Its process is the server's
    parent: the server and its ranks end when it does."""

    def __init__(self) -> None:
        self.server: ForkServer | None = None

    def start(self, *, python: str, root: str, preload: Sequence[str], timeout_s: float) -> dict[str, Any]:
        """Spawn the server once the node can run one; ``{"py_executable", "pid"}`` once it listens,
        else ``{"error": why}`` (and nothing left running)."""
        why = node_refusal(python=python, root=root)
        if why is None:
            self.server = ForkServer.spawn(env=IMPORT_ENV, preload=preload)
            why = self.server.wait_listening(timeout_s)
        if why is not None or self.server is None:
            self.close()
            return {"error": why}
        return {"py_executable": self.server.py_executable, "pid": self.server.proc.pid}

    def status(self) -> dict[str, Any]:
        """The server's ``status`` reply once its preload is done (what it loaded, what failed)."""
        if self.server is None or not self.server.alive():
            return {"error": "no fork server is running on this node"}
        return self.server.request({"op": "status"})

    def close(self) -> None:
        """Stop the server (it ends its children) and remove its socket folder."""
        if self.server is not None:
            self.server.close()
            self.server = None


class NodeForkServers:
    """The driver's handle on one run's per-node servers: each rank's launch, then :meth:`close`."""

    def __init__(self, servers: dict[str, NodeServer], hosts: dict[str, Any], bundles: dict) -> None:
        self.servers = servers  # Ray node id -> its server
        self.hosts = hosts  # Ray node id -> the actor holding its server
        self._bundles = bundles  # (placement group id, bundle index) -> Ray node id

    @classmethod
    def start(cls, pgs: Sequence[Any], *, family: str, timeout_s: float = 60.0) -> NodeForkServers:
        """One server on every node holding a bundle of ``pgs`` (reserved), preloading
        ``BASE_PRELOAD`` and ``family``'s modules; waits at most ``timeout_s`` for them to listen."""
        bundles = {
            (pg.id.hex(), int(b)): node
            for pg in pgs
            for b, node in ray.util.placement_group_table(pg)["bundles_to_node_id"].items()
        }
        names = _node_names()
        preload = [*BASE_PRELOAD, *forkserver.family_modules(family)]
        host_cls = ray.remote(num_cpus=0)(ForkServerHost)
        hosts, refs = {}, {}
        for node in sorted(set(bundles.values())):
            hosts[node] = host_cls.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                runtime_env={"env_vars": dict(WORKER_ENV)},
            ).remote()
            refs[node] = hosts[node].start.remote(
                python=sys.executable, root=PACKAGE_ROOT, preload=preload, timeout_s=timeout_s
            )
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        servers = {
            node: _answer(names.get(node, node[:8]), ref, answered=ref in ready, timeout_s=timeout_s)
            for node, ref in refs.items()
        }
        out = cls(servers, hosts, bundles)
        for node, server in servers.items():  # a node that cannot serve keeps no actor either
            if server.py_executable is None:
                out._drop(node)
        return out

    def runtime_env(self, pg: Any, bundle_index: int) -> dict[str, Any]:
        """The runtime_env fields of a rank in bundle ``bundle_index`` of ``pg``: its node's
        launcher (``py_executable``), or ``env_vars`` naming why its process starts the ordinary way."""
        node = self._bundles.get((pg.id.hex(), bundle_index))
        server = self.servers.get(node) if node is not None else None
        if server is None:
            return {"env_vars": {MISS_ENV: "its bundle's node was not among the reserved ones"}}
        if server.py_executable is None:
            return {"env_vars": {MISS_ENV: f"on node {server.node}: {server.miss}"}}
        return {"py_executable": server.py_executable}

    def status(self) -> dict[str, dict[str, Any]]:
        """Per node with a server: its ``status`` reply (waits for its preload)."""
        return {node: ray.get(host.status.remote(), timeout=300) for node, host in self.hosts.items()}

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop every node's server, then kill its actor (call it once the ranks' actors are killed)."""
        if not self.hosts:  # nothing to stop (and no Ray call: Ray's API would start a local instance)
            return
        refs = [host.close.remote() for host in self.hosts.values()]
        with contextlib.suppress(ray.exceptions.RayError):
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for node in list(self.hosts):
            self._drop(node)

    def _drop(self, node: str) -> None:
        host = self.hosts.pop(node, None)
        if host is not None:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(host, no_restart=True)


def start_for_cluster(pgs: Sequence[Any], *, family: str) -> NodeForkServers | None:
    """Per-node servers for a run's reserved ``pgs``; None where the driver's own server serves
    every rank (a local Ray it started) or the fork server is off (``DHP_FORK_SERVER=0``)."""
    local = forkserver.current()
    if not forkserver.enabled() or (local is not None and local.serving):
        return None
    return NodeForkServers.start(pgs, family=family)


def _answer(node: str, ref: Any, *, answered: bool, timeout_s: float) -> NodeServer:
    """One node's outcome from its actor's ``start`` reply (or the lack of one)."""
    if not answered:
        return NodeServer(node, miss=f"its fork server did not start within {timeout_s:.0f}s")
    try:
        reply = ray.get(ref)
    except ray.exceptions.RayError as e:
        cause = getattr(e, "cause", None) or e
        first = (str(cause).strip().splitlines() or [""])[0]
        return NodeServer(node, miss=f"its fork server's actor failed: {type(cause).__name__}: {first}")
    if "error" in reply:
        return NodeServer(node, miss=reply["error"])
    return NodeServer(node, py_executable=reply["py_executable"], pid=reply["pid"])


def _node_names() -> dict[str, str]:
    """Ray node id -> ``IP (first 8 hex digits of the id)``, for the start-up line."""
    return {n["NodeID"]: f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})" for n in ray.nodes()}
