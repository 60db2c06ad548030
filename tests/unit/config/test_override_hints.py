"""An override Hydra's grammar refuses names itself and, when it holds brackets, says how to quote it."""

from __future__ import annotations

import pytest

from dhp.errors import ConfigError
from dhp.validation import load_config


def test_unquoted_brackets_in_a_list_get_the_quoting_fix() -> None:
    bad = "modules.llm.freeze_patterns=[lm_head, language_model.layers.[0-1]]"
    with pytest.raises(ConfigError) as info:
        load_config("tiny_vlm", ["train.steps=2", bad])
    (issue,) = info.value.issues
    assert issue.path == "modules.llm.freeze_patterns"
    assert issue.value == bad
    assert "quote" in issue.fix and "'language_model.layers.[0-1]'" in issue.fix
    # the suggested override itself parses and gives the intended globs
    suggested = issue.fix.split('e.g. "', 1)[1].rstrip('"')
    cfg = load_config("tiny_vlm", [suggested])
    assert list(cfg.modules["llm"].freeze_patterns) == ["lm_head", "language_model.layers.[0-1]"]


def test_plain_parse_error_keeps_the_key_value_fix() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("tiny_vlm", ["train.lr=1e-3)"])
    (issue,) = info.value.issues
    assert issue.path == "train.lr"
    assert "quote the value" in issue.fix
