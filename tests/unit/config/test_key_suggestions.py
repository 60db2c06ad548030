"""Mistyped keys: every one of a command line is reported at once, each with the closest key of its
section; group choices, ``+``/``~`` overrides and dict-valued sections (module names, extra numbers)
are not mistaken for keys."""

from __future__ import annotations

import pytest

from dhp.config.keys import did_you_mean, override_key_issues, unknown_key
from dhp.errors import ConfigError
from dhp.validation import load_config

pytestmark = pytest.mark.unit


def test_every_mistyped_override_is_reported_with_its_closest_key():
    with pytest.raises(ConfigError) as e:
        load_config("tiny_vlm", ["train.stesp=3", "modules.llm.parallel.tpp=2", "modules.vision.seqlen=4"])
    text = {i.path: i.rule for i in e.value.issues}
    assert set(text) == {"train.stesp", "modules.llm.parallel.tpp", "modules.vision.seqlen"}
    assert "did you mean train.steps?" in text["train.stesp"]
    assert "did you mean modules.llm.parallel.tp?" in text["modules.llm.parallel.tpp"]
    assert "did you mean modules.vision.seq_len?" in text["modules.vision.seqlen"]


def test_what_is_not_a_key_is_left_alone():
    ok = ["model=tiny", "cluster=local_cpu", "+train.extra=1", "~data.datasets", "modules.audio.gpus=2",
          "model.llm.extra.num_experts=8", "data.synthetic.patches=64", "train.optimizer.impl=fused"]  # fmt: skip
    assert override_key_issues(ok) == []
    assert unknown_key("train.optimizer.imp") == ("train.optimizer", ["impl"])
    assert did_you_mean("placemnt") == " (did you mean placement?)"
    assert did_you_mean("train.zzzzzz") == ""  # nothing close: no guess


def test_a_mistyped_key_in_a_users_yaml_gets_a_suggestion(tmp_path):
    path = tmp_path / "mine.yaml"
    groups = [
        "/model: tiny",
        "/cluster: local_cpu",
        "/parallel: sp2_tp2",
        "/data: synthetic_small",
        "/train: tiny",
    ]
    body = "".join(f"  - {g}\n" for g in groups)
    path.write_text(f"defaults:\n{body}  - _self_\nname: mine\ntrain:\n  stpes: 3\n")
    with pytest.raises(ConfigError, match=r"did you mean train\.steps\?"):
        load_config(str(path), [])
