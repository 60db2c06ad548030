"""A per-node process that imports torch, Ray and dhp's worker code once and forks every rank from it.

Why: each rank process of a run is a fresh Python that imports torch, torch.distributed,
transformers' model code and dhp's worker before it can build anything: about 5 CPU-s per rank on
this stack (measured on a 2-core box), so 4 ranks on 2 cores spend 10 s of wall time importing the
same modules. A forked child shares the server's already-loaded pages (copy on write), so a rank
starts in a fraction of a second of CPU. This is the stdlib's ``multiprocessing`` forkserver with
``set_forkserver_preload``, applied to Ray's worker processes.

How it plugs into Ray: the driver starts the server (:meth:`ForkServer.start`) on its node once its
config is read (a bad config starts nothing) and before its own heavy imports, with the ranks'
environment (``IMPORT_ENV``: the OpenMP thread count is read when torch loads). The actors of a
local Ray instance carry ``runtime_env={"py_executable": ...}`` naming :mod:`dhp.runtime.launch.forklaunch`,
which hands Ray's worker command to this server; the forked child then runs Ray's own
``default_worker.py`` and registers with the raylet under its own pid. A joined cluster's ranks
fork from a server of their own node instead, one per node the run's placement groups reserved,
each started by a small actor there for the run's lifetime (:mod:`dhp.runtime.launch.forknodes`).

Safety of the fork: the server never initialises CUDA (it refuses to fork once
``torch.cuda.is_initialized()``), holds one thread (it refuses with a second one), and freezes its
objects from the garbage collector (``gc.freeze``) so children do not copy pages by collecting them.
A child gets a session and process group of its own (Ray's clean-up of a dead worker kills that
worker's whole group: sharing the server's, one rank's death, or any rank's teardown, would take
the server and every rank forked beside it), the launcher's environment, working directory and
stdin/stdout/stderr, Python's and numpy's RNGs reseeded (torch's default generator is left as a fresh process has it: dhp seeds each
rank itself). Every refusal is answered with its reason; the launcher then starts the rank the
ordinary way and the rank reports the reason (``DistWorker.started``).

Memory: the server holds one copy of the imported modules (about 0.5 GB resident with torch and
transformers); each child shares those pages until it writes them.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import random
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dhp.models.registry import family_package
from dhp.runtime.launch.forklaunch import recv_msg, send_msg

#: the part of every rank's environment that its imports read (OpenMP sizes its pool when torch
#: loads): the server is started with it, so its children match a rank started the ordinary way
IMPORT_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
#: what every rank imports whatever the model (the worker module's imports), preloaded before any
#: family. Never Ray: its C++ core reads some settings (the job id, the raylet's pid) from the
#: environment once, when it loads, and a child would keep the server's; the server refuses to fork
#: once ``ray._raylet`` is loaded. Each rank imports Ray itself (about 0.4 CPU-s).
BASE_PRELOAD = (
    "torch",
    "torch.distributed",
    "dhp.parallel",
    "dhp.parallel.lora",
    "dhp.checkpoint",
    "dhp.checkpoint.async_state",
    "dhp.data.batch",
    "dhp.data.remote",
    "dhp.metrics.record",
    "dhp.models.loading",
    "dhp.runtime.handoff.routing",
    "dhp.runtime.handoff.transport",
)
#: the variable a forked rank finds its server's pid in
FORKED_ENV = "DHP_FORKED_FROM"
#: set to 0 to start every rank process the ordinary way
ENABLE_ENV = "DHP_FORK_SERVER"
_LAUNCHER = Path(__file__).with_name("forklaunch.py")
PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the folder holding this dhp package

_CURRENT: ForkServer | None = None


def enabled() -> bool:
    """False when ``DHP_FORK_SERVER=0`` (or the platform has no fork)."""
    return os.environ.get(ENABLE_ENV, "1") != "0" and hasattr(os, "fork") and sys.platform == "linux"


def current() -> ForkServer | None:
    """The server this driver started and has not closed, if any."""
    return _CURRENT if _CURRENT is not None and _CURRENT.alive() else None


def runtime_env_fields() -> dict[str, str]:
    """``{"py_executable": ...}`` for an actor's runtime_env when a server serves this node, else {}."""
    server = current()
    return {} if server is None or not server.serving else {"py_executable": server.py_executable}


class ForkServer:
    """The driver's handle on its node's fork server: start, preload more modules, close."""

    def __init__(self, proc: subprocess.Popen, path: str, tmpdir: str) -> None:
        self.proc = proc
        self.path = path
        self._tmpdir = tmpdir
        self.serving = False  # set once a local Ray instance uses it (connect_ray)
        self.py_executable = f"{sys.executable} -S {_LAUNCHER} {path}"

    @classmethod
    def start(cls, *, env: dict[str, str] = IMPORT_ENV, preload: Sequence[str] = BASE_PRELOAD) -> ForkServer:
        """Spawn this driver's server (it preloads ``preload`` at once, beside whatever the caller
        does next); :func:`current` returns it until it is closed."""
        global _CURRENT
        _CURRENT = cls.spawn(env=env, preload=preload)
        return _CURRENT

    @classmethod
    def spawn(cls, *, env: dict[str, str], preload: Sequence[str]) -> ForkServer:
        """Spawn a server child of this process in a folder of its own (so two servers on one
        machine never share a socket); it ends when this process does. Not :func:`current`."""
        tmpdir = tempfile.mkdtemp(prefix="dhp-fork-")
        path = os.path.join(tmpdir, "server.sock")
        cmd = [
            sys.executable,
            "-m",
            "dhp.runtime.launch.forkserver",
            path,
            str(os.getpid()),
            ",".join(preload),
        ]
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=PACKAGE_ROOT,  # `-m` puts the working directory first: the server imports this dhp
            start_new_session=True,  # a Ctrl-C at the terminal is the driver's to handle, not this one's
        )
        return cls(proc, path, tmpdir)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_listening(self, timeout_s: float) -> str | None:
        """Wait until the server's socket exists (it binds it before its imports): None, or why not."""
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.path):
            if not self.alive():
                return f"the fork server exited with code {self.proc.poll()} before listening"
            if time.monotonic() > deadline:
                return f"the fork server did not listen within {timeout_s:.0f}s"
            time.sleep(0.02)
        return None

    def request(self, obj: dict[str, Any], *, timeout_s: float = 120.0) -> dict[str, Any]:
        """One request/reply (``preload`` or ``status``); waits for the server's socket to appear."""
        deadline = time.monotonic() + timeout_s
        while True:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                try:
                    sock.connect(self.path)
                except OSError:
                    if not self.alive() or time.monotonic() > deadline:
                        return {"error": f"fork server not reachable (exit code {self.proc.poll()})"}
                    time.sleep(0.05)
                    continue
                sock.settimeout(max(1.0, deadline - time.monotonic()))
                send_msg(sock, obj)
                reply, _ = recv_msg(sock)
                return reply or {"error": "fork server closed the connection"}

    def preload(self, modules: Sequence[str]) -> None:
        """Ask the server to import ``modules`` too (a family's model code, once the config names it).
        Returns at once; the server imports them before it forks the next rank."""
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(self.path)
            send_msg(sock, {"op": "preload", "modules": list(modules)})

    def close(self) -> None:
        """Stop the server and remove its socket. Call it after Ray's shutdown: a child still running
        then (a rank whose launcher Ray stopped) gets SIGTERM, and SIGKILL a second later."""
        global _CURRENT
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self._tmpdir)
        if _CURRENT is self:
            _CURRENT = None


def start_for_driver(family: str | None = None, *, ray_address: str | None = None) -> ForkServer | None:
    """Start this node's server for a driver that may start its own local Ray (no
    ``cluster.ray_address`` given as ``ray_address``, ``$RAY_ADDRESS`` unset, fork server enabled,
    no Ray connected in this process yet), preloading ``family``'s modules too, before the driver's
    own heavy imports; None otherwise (a joined cluster's nodes start their own servers,
    dhp.runtime.launch.forknodes; a server already running in this process keeps serving)."""
    ray = sys.modules.get("ray")  # looked up, not imported: this runs before the driver's imports
    if ray is not None and ray.is_initialized():
        return None
    if not enabled() or ray_address or os.environ.get("RAY_ADDRESS") or current() is not None:
        return None
    return ForkServer.start(preload=(*BASE_PRELOAD, *(family_modules(family) if family else ())))


@contextlib.contextmanager
def for_driver(family: str | None = None, *, ray_address: str | None = None) -> Iterator[ForkServer | None]:
    """:func:`start_for_driver` for the ``with`` block; the server is stopped when it ends."""
    server = start_for_driver(family, ray_address=ray_address)
    try:
        yield server
    finally:
        if server is not None:
            server.close()


def use_for_local_ray() -> None:
    """The driver started a local Ray instance: its actors are forked from this node's server."""
    server = current()
    if server is not None:
        server.serving = True


def preload_family(family: str) -> None:
    """Ask the server serving this node's local Ray, if any, to import ``family``'s modules before
    it forks the next rank (a no-op for a family it holds). A server started for another family, or
    none (a test session's, a sweep's), would otherwise leave every rank to import them itself."""
    server = current()
    if server is not None and server.serving:
        server.preload(family_modules(family))


def close_current() -> None:
    """Stop the server this driver started, if any (a joined cluster, the end of a run); one that
    died (a SIGKILL) still has its socket folder removed."""
    server = _CURRENT
    if server is not None:
        server.close()


def family_modules(family: str) -> list[str]:
    """The modules a rank of ``family`` imports beyond :data:`BASE_PRELOAD`: the family and its
    modules (transformers' model code, which the family module itself loads only to build)."""
    package = family_package(family)  # a flavour's name is its family folder's
    return [f"{package}.family", f"{package}.modules"]


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ---- the server process --------------------------------------------------------------------------


class _Server:
    def __init__(self, path: str, parent: int) -> None:
        self.parent = parent
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.children: dict[int, socket.socket] = {}  # child pid -> its launcher's connection
        self.forked: set[int] = set()  # every child not reaped yet (with or without a launcher)
        self.failed: dict[str, str] = {}  # module -> why its preload failed
        self.loaded: list[str] = []

    def preload(self, modules: Sequence[str]) -> None:
        for name in modules:
            if name in self.loaded or name in self.failed:
                continue
            try:
                importlib.import_module(name)
                self.loaded.append(name)
            except Exception as e:  # the rank's own import of it raises the error where it belongs
                self.failed[name] = f"{type(e).__name__}: {e}"
        gc.collect()
        gc.freeze()

    def refusal(self) -> str | None:
        """Why forking now would be unsafe, or None."""
        if "ray._raylet" in sys.modules:
            return "Ray is loaded in the fork server (it reads its job id once, when it loads)"
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return "CUDA is initialised in the fork server (a forked child could not use it)"
        tasks = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
        if threading.active_count() > 1 or tasks > 1:
            return f"the fork server runs {tasks} threads (a fork copies only one)"
        return None

    def serve(self) -> None:
        while True:
            if os.getppid() != self.parent:  # the driver is gone (main() then ends the children)
                return
            self._reap()
            ready, _, _ = select.select([self.listener, *self.children.values()], [], [], 0.2)
            for sock in ready:
                if sock is self.listener:
                    conn, _ = self.listener.accept()
                    try:
                        self._handle(conn)
                    except OSError:  # that client went away mid-request: the server serves on
                        conn.close()
                else:  # a launcher's connection: EOF means the launcher died; its child goes too
                    with contextlib.suppress(OSError):
                        if sock.recv(1):
                            continue
                    pid = next((p for p, c in self.children.items() if c is sock), None)
                    if pid is not None:
                        del self.children[pid]  # nobody to tell its exit status; _reap still reaps it
                        sock.close()
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)

    def _handle(self, conn: socket.socket) -> None:
        try:
            msg, fds = recv_msg(conn, with_fds=3)
        except OSError:
            conn.close()
            return
        if msg is None:
            conn.close()
            return
        op = msg.get("op")
        if op == "preload":
            conn.close()
            self.preload(msg.get("modules", []))
        elif op == "status":
            send_msg(conn, {"loaded": self.loaded, "failed": self.failed, "refusal": self.refusal()})
            conn.close()
        elif op == "spawn":
            self._spawn(conn, msg, fds)
        else:
            conn.close()

    def _spawn(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        why = self.refusal() or (None if len(fds) == 3 else f"{len(fds)} of 3 standard descriptors came")
        if why:
            send_msg(conn, {"error": why})
            conn.close()
            for fd in fds:
                os.close(fd)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._become(msg, fds, keep=conn)
        self.forked.add(pid)
        for fd in fds:
            os.close(fd)
        try:
            send_msg(conn, {"pid": pid})
        except OSError:  # the launcher died before its answer: nobody stands in for this child
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            raise
        self.children[pid] = conn

    def _become(self, msg: dict, fds: list[int], *, keep: socket.socket) -> None:
        """In the child: drop the server's sockets, take the launcher's place, run Ray's worker."""
        code = 1
        try:
            # a process group of its own, as Ray gives a rank it starts itself: Ray's worker cleanup
            # kills the dead worker's whole process group, which would otherwise be this server's
            # (the server and every other rank forked from it)
            os.setsid()
            self.listener.close()
            for c in self.children.values():
                c.close()
            keep.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
                signal.signal(s, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            gc.unfreeze()
            os.environ.clear()
            os.environ.update(msg["env"])
            os.environ[FORKED_ENV] = str(os.getppid())
            os.chdir(msg["cwd"])
            argv = list(msg["argv"])
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            # a fresh interpreter puts $PYTHONPATH right after the script's folder: so does the child
            extra = [e for e in msg["env"].get("PYTHONPATH", "").split(os.pathsep) if e and e not in sys.path]
            sys.path[1:1] = extra
            random.seed()
            np = sys.modules.get("numpy")
            if np is not None:
                np.random.seed()
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback  # reason: only a child that failed pays for it

            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.forked.discard(pid)
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):
                send_msg(conn, {"exit": code if code >= 0 else 128 - code})
            conn.close()

    def _end_children(self, grace_s: float = 1.0) -> None:
        """SIGTERM every child still running, SIGKILL what is left after ``grace_s``: a rank outlives
        neither its driver nor the server (Ray may have stopped only the launchers it started)."""
        pids = set(self.children) | self.forked
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.02)
            self._reap()
            pids = {p for p in pids if _running(p)}
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def main(argv: list[str]) -> None:
    path, parent, preload = argv[0], int(argv[1]), [m for m in argv[2].split(",") if m]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = _Server(path, parent)  # bound before the imports: the driver's requests queue meanwhile
    server.preload(preload)
    try:
        server.serve()
    except SystemExit:  # close(): the driver is done with its ranks
        pass
    finally:
        server.listener.close()
        server._end_children()
        with contextlib.suppress(OSError):  # a parent that died never removes them (close() does)
            os.unlink(path)
            os.rmdir(os.path.dirname(path))


if __name__ == "__main__":
    main(sys.argv[1:])
