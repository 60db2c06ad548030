"""Reach every configured tracker before Ray starts: the MLflow store answers, W&B's mode can work.

``dhp.config.validate_metrics`` checks what a config says (logger names, packages installed, the
wandb mode's spelling). This checks what the machine allows, in a second or two, before a run dir,
Ray or any tracker run exists: an unreachable MLflow store, a file store MLflow refuses, or W&B
online with no API key or no route to its server. Each problem is one
:class:`~dhp.errors.ConfigIssue` (key path, value, what went wrong, the fix), all raised together.
"""

from __future__ import annotations

import contextlib
import netrc
import os
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

from dhp.errors import ConfigError, ConfigIssue

#: seconds one tracker may take to answer (a TCP connect, one store request)
REACH_TIMEOUT_S = 3.0
WANDB_DEFAULT_URL = "https://api.wandb.ai"


def check_trackers(metrics: Any) -> None:
    """Raise one ConfigError listing every configured tracker this machine cannot use now."""
    issues: list[ConfigIssue] = []
    if "mlflow" in metrics.loggers:
        issues += _mlflow_issues(metrics.mlflow)
    if "wandb" in metrics.loggers:
        issues += _wandb_issues(metrics.wandb)
    if issues:
        raise ConfigError(issues)


def wandb_mode(cfg: Any) -> str:
    """The mode a wandb run would take: ``metrics.wandb.mode``, else ``$WANDB_MODE``, else online."""
    return cfg.mode or os.environ.get("WANDB_MODE") or "online"


def _wandb_issues(cfg: Any) -> list[ConfigIssue]:
    mode = wandb_mode(cfg)
    if mode in ("offline", "disabled", "dryrun"):
        return []
    offline = "set metrics.wandb.mode=offline (upload later with `wandb sync <run_dir>/wandb/offline-run-*`)"
    base = os.environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_URL
    host = urlparse(base).hostname or base
    if not os.environ.get("WANDB_API_KEY") and not _netrc_has(host):
        return [
            ConfigIssue(
                path="metrics.wandb.mode",
                value=mode,
                rule=f"W&B is online but no API key is set ($WANDB_API_KEY, or ~/.netrc for {host})",
                fix=f"run `wandb login`, or {offline}",
            )
        ]
    err = _tcp_reach(base)
    if err:
        return [
            ConfigIssue(
                path="metrics.wandb.mode",
                value=mode,
                rule=f"W&B is online but its server {base} does not answer ({err})",
                fix=f"check the network or $WANDB_BASE_URL, or {offline}",
            )
        ]
    return []


def _netrc_has(host: str) -> bool:
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def _mlflow_issues(cfg: Any) -> list[ConfigIssue]:
    import mlflow  # mlflow is an optional extra: loaded only when configured
    from mlflow.exceptions import MlflowException  # (optional extra)
    from mlflow.tracking import MlflowClient  # (optional extra)

    uri = cfg.tracking_uri or mlflow.get_tracking_uri()
    where = "metrics.mlflow.tracking_uri"
    fix = (
        "set metrics.mlflow.tracking_uri to a store that answers: http://host:5000 (a running "
        "`mlflow server`), sqlite:///mlflow.db (needs sqlalchemy), or file:DIR with "
        "MLFLOW_ALLOW_FILE_STORE=true; or remove mlflow from metrics.loggers"
    )
    if urlparse(uri).scheme in ("http", "https"):
        err = _tcp_reach(uri)
        if err:
            return [ConfigIssue(where, uri, f"no MLflow server answers ({err})", fix)]
    try:
        with _one_quick_request():
            MlflowClient(tracking_uri=uri).get_experiment_by_name(cfg.experiment)
    except (MlflowException, ImportError, OSError) as e:  # MLflow's own words, first sentence
        reason = " ".join(str(e).split())
        reason = reason.split(". ")[0].rstrip(".") or type(e).__name__
        return [ConfigIssue(where, uri, f"MLflow cannot use this store: {reason}", fix)]
    return []


def _tcp_reach(url: str) -> str:
    """'' when something listens at ``url``'s host and port, else the connect error."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname or "", port), timeout=REACH_TIMEOUT_S).close()
    except OSError as e:
        return f"{parsed.hostname}:{port}: {e}"
    return ""


@contextlib.contextmanager
def _one_quick_request() -> Iterator[None]:
    """MLflow retries a failing HTTP request with backoff for minutes: here once, with a timeout."""
    keys = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(REACH_TIMEOUT_S))}
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
