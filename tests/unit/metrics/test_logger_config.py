"""``metrics.loggers`` validation: known names, jsonl kept, a configured tracker must be installed."""

from __future__ import annotations

import pytest

import dhp.config.validate_metrics as vm
from dhp.errors import ConfigError
from dhp.metrics.loggers import flat_config, flat_scalars
from dhp.validation import load_config

pytestmark = pytest.mark.unit


def _issues(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config("tiny_vlm", list(overrides))
    return [str(i) for i in e.value.issues]


def test_default_is_jsonl_and_legacy_tensorboard_switch_still_loads():
    assert list(load_config("tiny_vlm", []).metrics.loggers) == ["jsonl"]
    assert load_config("tiny_vlm", ["train.tensorboard=true"]).train.tensorboard is True


def test_unknown_duplicate_and_missing_jsonl_are_reported_together():
    issues = _issues("metrics.loggers=[tensorbord,tensorboard,tensorboard]", "metrics.wandb.mode=ofline")
    text = "\n".join(issues)
    assert "'tensorbord': unknown logger; known: jsonl, tensorboard, wandb, mlflow" in text
    assert "a logger is listed twice" in text
    assert "jsonl is required" in text
    assert "metrics.wandb.mode = 'ofline'" in text


def test_configured_but_not_installed_names_the_extra(monkeypatch):
    # the real importlib lookup, for a module name that is certainly not installed
    monkeypatch.setitem(vm.PACKAGES, "wandb", ("dhp_no_such_wandb_pkg", "wandb"))
    (issue,) = _issues("metrics.loggers=[jsonl,wandb]")
    assert "the dhp_no_such_wandb_pkg package is not installed" in issue
    assert "pip install -e '.[wandb]'" in issue


def test_flat_scalars_and_config():
    rec = {"step": 3, "loss": 1.5, "peak_mem_bytes": {"llm/0": 7}, "bad_samples": {}, "ok": True}
    assert flat_scalars(rec) == {"loss": 1.5, "peak_mem_bytes/llm/0": 7.0}
    assert flat_config({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": "1", "a.c": "[1, 2]", "d": "None"}
