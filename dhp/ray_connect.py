"""One way to connect to Ray, for ``dhp plan`` (reserving a plan) and ``dhp train`` alike.

``cluster.ray_address`` wins, then ``$RAY_ADDRESS``; otherwise a new local instance is started with
``address="local"``, so an unrelated ``ray start`` head on the machine is never joined by accident.
Neutral on purpose: ``dhp.plan`` must not import ``dhp.runtime``, and both need this.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import ray

from dhp.errors import PlanError

#: Ray settings of a local instance dhp starts: no dashboard, and no default workers started ahead of
#: use (every dhp actor carries its own ``runtime_env``, so Ray could never hand it one of those:
#: they would only cost ~2 s of CPU at start).
LOCAL_RAY: dict[str, Any] = {
    "include_dashboard": False,
    "log_to_driver": False,
    "_system_config": {"prestart_worker_first_driver": False},
}


def connect_ray(
    *, cluster: Any, resources: dict[str, float], on_local_start: Callable[[], Any] | None = None
) -> bool:
    """Join ``cluster.ray_address`` or ``$RAY_ADDRESS`` if set, else start a NEW local Ray instance
    (``address="local"``: a ``ray start`` head on this machine is never joined by accident) with
    ``resources`` (``{"CPU": n, "GPU": m}``, rounded up; at least one CPU). Reserves nothing.

    Returns True when this call initialised Ray in this process, so ``Trainer.close()`` calls
    ``ray.shutdown()``: that stops a local instance, but for a joined cluster it only disconnects
    this driver (the job's actors and placement groups end with it; the cluster and its other jobs
    stay up). False when Ray was already initialised (the caller's, left alone).

    Joining a cluster that uses token authentication (Ray >= 2.60 turns it on for a new local
    cluster) needs ``RAY_AUTH_MODE=token`` and the token (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``
    or ``~/.ray/auth_token``) in this process's environment: Ray switches auth on by itself only
    for a cluster it finds on its own, never for an explicit address. A join Ray refuses raises
    PlanError naming the address, where it came from, Ray's reason and the fix.

    ``ray.init`` installs Ray's own SIGTERM handler (it aborts the process with 134); the caller's
    handler is put back afterwards. ``on_local_start`` runs once a new local instance is up (the
    driver starts its reaper there).
    """

    if ray.is_initialized():
        return False
    term = signal.getsignal(signal.SIGTERM)
    # dhp reports a failed rank itself (module, rank, reason); Ray would also print the coloured
    # traceback of every failed result nobody fetched once a step is abandoned
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    if not sys.stderr.isatty():  # Ray's "(raylet) ..." lines: colour codes only on a terminal
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    address = cluster.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        source = "cluster.ray_address" if cluster.ray_address else "$RAY_ADDRESS"
        _check_reachable(address, source=source)  # Ray retries a dead address for minutes
        try:
            ray.init(address=address, log_to_driver=False)
            _keep_handler(signal.SIGTERM, term)
        except ConnectionError as e:
            lines = str(e.__cause__ or e).strip().splitlines() or [str(e)]
            reason = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1]).strip()
            raise PlanError(  # Ray's cause is a traceback; its last error line, first sentence
                f"cannot join the Ray cluster at {address!r} (from {source}): {e}: "
                f"{reason.split('. ')[0].rstrip('.')}. Fix: check the address (the head's host:port "
                "from `ray start --head`) and that the head is up; for a cluster with token "
                "authentication, set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH "
                "(default ~/.ray/auth_token) in dhp's environment."
            ) from e
        return True
    need = resources
    # at least this machine's usable cores: Ray starts at most min(cores, num_cpus) worker processes at
    # once, so an instance sized to the actors' fractional CPUs (4 x 0.25 = 1) starts the ranks one by one
    cpus = max(1, math.ceil(need.get("CPU", 1.0) - 1e-9), usable_cores())
    gpus = math.ceil(need.get("GPU", 0.0) - 1e-9)
    kwargs = {"num_gpus": gpus} if gpus else {}
    # address="local": always a new instance of our own, never a `ray start` head found on this machine
    with _quiet_default_token_auth():
        ray.init(address="local", num_cpus=cpus, **LOCAL_RAY, **kwargs)
    _keep_handler(signal.SIGTERM, term)
    if on_local_start is not None:
        on_local_start()
    return True


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container's cpuset limits), not the
    host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


#: Ray's logger for the notice it prints when it turns token authentication on by itself
_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


class _DropAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


@contextlib.contextmanager
def _quiet_default_token_auth() -> Iterator[None]:
    """Drop Ray's "Token authentication is enabled for this Ray cluster" notice while dhp starts
    its own local instance, and nothing else.

    Ray >= 2.60 turns token authentication on for a new local instance and says so on every start.
    The protection stays exactly as Ray sets it (a token is still required to join this instance;
    only the notice goes). That is safe to hide because the instance is dhp's own: started here for
    this command, never shared, stopped when the command ends. The notice that auth is *disabled*,
    and every other Ray message, still shows.
    """
    log, notice = logging.getLogger(_AUTH_LOGGER), _DropAuthNotice()
    log.addFilter(notice)
    try:
        yield
    finally:
        log.removeFilter(notice)


def _keep_handler(signum: int, handler: Any) -> None:
    """Put ``handler`` back for ``signum`` (main thread only; None: it was not set from Python)."""
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signum, handler)


def _check_reachable(address: str, *, source: str, timeout_s: float = 5.0) -> None:
    """PlanError at once when nothing listens at a ``host:port`` (or ``ray://host:port``) address.

    ``ray.init`` keeps retrying an address with no head behind it (over 90 s seen here); a TCP
    connect tells in ``timeout_s``. ``auto`` and addresses without a port are left to Ray.
    """

    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise PlanError(
            f"no Ray cluster answers at {address!r} (from {source}): {e}. Fix: start the head "
            "(`ray start --head`) or correct the address; unset it to start a local Ray."
        ) from e
