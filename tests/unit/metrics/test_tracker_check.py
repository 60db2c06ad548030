"""Trackers are reached before Ray starts: one clean ConfigError, no run dir, no tracker run left."""

from __future__ import annotations

import socket
import time

import pytest
from omegaconf import OmegaConf
from typer.testing import CliRunner

from dhp.cli import app
from dhp.errors import ConfigError
from dhp.metrics.tracker_check import check_trackers


def _metrics(**kw) -> object:
    base = {"loggers": ["jsonl"], "wandb": {"project": "dhp", "entity": None, "mode": None}}
    base["mlflow"] = {"tracking_uri": None, "experiment": "dhp"}
    return OmegaConf.create({**base, **kw})


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


def test_unreachable_mlflow_server_fails_fast_with_one_fix() -> None:
    uri = f"http://127.0.0.1:{_closed_port()}"
    m = _metrics(loggers=["jsonl", "mlflow"], mlflow={"tracking_uri": uri, "experiment": "dhp"})
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        check_trackers(m)
    assert time.perf_counter() - t0 < 10  # no minutes of HTTP retries
    (issue,) = info.value.issues
    assert issue.path == "metrics.mlflow.tracking_uri" and issue.value == uri
    assert "no MLflow server answers" in issue.rule
    assert str(info.value).count("Fix:") == 1 and "see the message" not in str(info.value)


def test_file_store_needs_mlflows_opt_in(tmp_path, monkeypatch) -> None:
    m = _metrics(
        loggers=["jsonl", "mlflow"], mlflow={"tracking_uri": f"file:{tmp_path}/ml", "experiment": "x"}
    )
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError, match="MLflow cannot use this store"):
        check_trackers(m)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_trackers(m)  # the same store, allowed: no error


def test_wandb_online_without_a_key_names_offline_mode(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    for var in ("WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError) as info:
        check_trackers(_metrics(loggers=["jsonl", "wandb"]))
    (issue,) = info.value.issues
    assert issue.path == "metrics.wandb.mode" and "metrics.wandb.mode=offline" in issue.fix
    check_trackers(
        _metrics(loggers=["jsonl", "wandb"], wandb={"project": "d", "entity": None, "mode": "offline"})
    )
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_trackers(_metrics(loggers=["jsonl", "wandb"]))


def test_train_refuses_before_a_run_dir_exists(tmp_path) -> None:
    uri = f"http://127.0.0.1:{_closed_port()}"
    out_dir = tmp_path / "runs"
    args = ["train", "conf=tiny_vlm", "metrics.loggers=[jsonl,mlflow]", f"metrics.mlflow.tracking_uri={uri}"]
    result = CliRunner().invoke(app, [*args, f"train.output_dir={out_dir}"])
    assert isinstance(result.exception, ConfigError), result.output
    assert not out_dir.exists()  # no run dir, so no empty run for `dhp runs` to list
