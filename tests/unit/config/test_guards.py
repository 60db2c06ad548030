"""Numbers and names that make no sense are refused with the key path, whatever the recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dhp.errors import ConfigError
from dhp.validation import load_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "override, path",
    [
        ("train.lr=inf", "train.lr"),
        ("train.lr=nan", "train.lr"),
        ("train.grad_clip=-inf", "train.grad_clip"),
        ("train.step_timeout_s=0", "train.step_timeout_s"),
        ("train.restart_wait_s=-1", "train.restart_wait_s"),
        ("train.max_restarts=-1", "train.max_restarts"),
        ("name=../../escape", "name"),
        ("name=a/b", "name"),
        ("name=..", "name"),
        ("+modules.audio.gpus=1", "modules.audio"),
    ],
)
def test_nonsense_is_refused_naming_the_key(override: str, path: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config("tiny_vlm", [override])
    assert any(i.path == path for i in e.value.issues), e.value


def test_unknown_module_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="known modules: vision, llm"):
        load_config("tiny_vlm", ["+modules.audio.gpus=1"])


def test_model_type_must_match_the_family(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type='llama'"):
        load_config("tiny_vlm", [f"model.path={tmp_path}"])
