"""``train.optimizer.impl``: the default is fused on both devices; a bad or unrunnable impl is a ConfigError."""

from __future__ import annotations

import pytest

from dhp.config import validate_optimizer as vo
from dhp.errors import ConfigError
from dhp.validation import load_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("recipe", ["qwen_vl_32b", "tiny_vlm"])
def test_default_is_fused_where_torch_has_it(recipe: str) -> None:
    cfg = load_config(recipe)
    assert cfg.cluster.device in vo.FUSED_OPTIMIZER_DEVICES
    assert cfg.train.optimizer.impl == "fused"


def test_unknown_impl_names_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny_vlm", ["train.optimizer.impl=apex"])
    assert "train.optimizer.impl" in str(err.value) and "for_loop" in str(err.value)


def test_fused_on_a_device_without_it_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # a torch build whose fused AdamW covers CUDA only (torch < 2.4 had no CPU kernel)
    monkeypatch.setattr(vo, "FUSED_OPTIMIZER_DEVICES", ("cuda",))
    with pytest.raises(ConfigError) as err:
        load_config("tiny_vlm", ["train.optimizer.impl=fused"])
    msg = str(err.value)
    assert "train.optimizer.impl" in msg and "cluster.device=cpu" in msg and "foreach" in msg
    assert load_config("tiny_vlm", ["train.optimizer.impl=foreach"]).train.optimizer.impl == "foreach"
