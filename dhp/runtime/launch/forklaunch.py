"""The command Ray runs for a rank process on a node with a fork server (:mod:`dhp.runtime.launch.forkserver`).

Ray execs ``python -S forklaunch.py SOCKET default_worker.py ARGS...`` in place of ``python
default_worker.py ARGS...`` (the actor's ``runtime_env`` ``py_executable``). This process imports
only the standard library (about 30 ms of CPU): it hands its argv, environment, working directory
and stdin/stdout/stderr to the server, which forks a child that already holds torch, Ray and dhp's
worker code and runs ``default_worker.py`` there. It then stands in for that child until it ends:
SIGTERM, SIGINT and SIGHUP are passed on, and it exits with the child's status (128 + the signal for
a child killed by one). The server kills the child when this process dies (Ray may kill the process
it started rather than the one that registered).

Where the server cannot serve (no socket, a refusal: CUDA already initialised there, a second thread
in it), this process becomes the worker the ordinary way (``exec python default_worker.py ...``)
and says why on its stderr, which is the rank's Ray worker log; the rank reports it too
(``DHP_FORK_SERVER_MISS``) and the driver's start-up line names it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time

#: the environment variable a rank started the ordinary way finds the reason in
MISS_ENV = "DHP_FORK_SERVER_MISS"
_HEADER = struct.Struct("!I")


def send_msg(sock: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    """One length-prefixed JSON message; ``fds`` ride along with its first bytes (SCM_RIGHTS)."""
    data = json.dumps(obj).encode()
    frame = _HEADER.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        frame = frame[sent:]
    if frame:  # never an empty send: the server may have answered and closed already (EPIPE)
        sock.sendall(frame)


def recv_msg(sock: socket.socket, *, with_fds: int = 0) -> tuple[dict | None, list[int]]:
    """The next message (None at EOF) and any descriptors that came with it."""
    fds: list[int] = []
    buf = b""
    while len(buf) < _HEADER.size:
        if with_fds and not fds:
            chunk, got, _flags, _addr = socket.recv_fds(sock, 65536, with_fds)
            fds.extend(got)
        else:
            chunk = sock.recv(65536)
        if not chunk:
            return None, fds
        buf += chunk
    (n,) = _HEADER.unpack(buf[: _HEADER.size])
    body = buf[_HEADER.size :]
    while len(body) < n:
        chunk = sock.recv(n - len(body))
        if not chunk:
            return None, fds
        body += chunk
    return json.loads(body[:n]), fds


def _plain_start(argv: list[str], reason: str) -> None:
    """Become the worker the ordinary way: a fresh interpreter importing everything itself."""
    print(f"dhp: this rank process starts without the fork server: {reason}", file=sys.stderr, flush=True)
    os.environ[MISS_ENV] = reason
    os.execv(sys.executable, [sys.executable, *argv])


def _connect(sock: socket.socket, path: str, wait_s: float = 5.0) -> None:
    """Connect, waiting up to ``wait_s`` for a server that is still starting (its folder exists, its
    socket not yet); a missing folder or a dead server fails at once."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock.connect(path)
            return
        except (FileNotFoundError, ConnectionRefusedError):
            if not os.path.isdir(os.path.dirname(path)) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main(args: list[str]) -> int:
    path, argv = args[0], args[1:]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _connect(sock, path)
        request = {"op": "spawn", "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
        send_msg(sock, request, fds=[0, 1, 2])
        reply, _ = recv_msg(sock)
    except OSError as e:
        reply = {"error": f"cannot reach it at {path} ({e.strerror or e})"}
    if reply is None or "pid" not in reply:
        sock.close()
        _plain_start(argv, (reply or {}).get("error", "it closed the connection"))
    child = int(reply["pid"])

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)
    while True:
        try:
            done, _ = recv_msg(sock)
        except InterruptedError:
            continue
        if done is None:  # the server went away: the child is no longer watched for us
            return 1
        if "exit" in done:
            return int(done["exit"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
