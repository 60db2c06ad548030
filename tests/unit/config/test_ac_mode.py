"""The activation-checkpointing mode parser and its validation (one parser for config, plan, parallel)."""

import pytest

from dhp.config.ac import AcMode, parse_ac_mode
from dhp.errors import ConfigError
from dhp.validation import load_config


@pytest.mark.unit
@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("off", AcMode("off")),
        (False, AcMode("off")),
        ("False", AcMode("off")),
        ("full", AcMode("full")),
        (True, AcMode("full")),
        ("every_n:1", AcMode("full")),
        ("every_n:3", AcMode("every_n", 3)),
        ("selective", AcMode("selective")),
    ],
)
def test_parse_ac_mode(value, want) -> None:
    assert parse_ac_mode(value) == want


@pytest.mark.unit
@pytest.mark.parametrize("value", ["sometimes", "every_n:0", "every_n:x", ""])
def test_parse_ac_mode_rejects(value) -> None:
    with pytest.raises(ValueError, match="activation-checkpointing mode"):
        parse_ac_mode(value)


@pytest.mark.unit
def test_bad_ac_mode_is_a_config_error_with_its_path() -> None:
    with pytest.raises(ConfigError, match=r"modules\.llm\.activation_checkpointing"):
        load_config("tiny_vlm", ["modules.llm.activation_checkpointing=sometimes"])
    cfg = load_config("tiny_vlm", ["modules.llm.activation_checkpointing=every_n:2"])
    assert parse_ac_mode(cfg.modules.llm.activation_checkpointing) == AcMode("every_n", 2)
