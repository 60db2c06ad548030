"""`dhp train conf=tiny_vlm data.path=my.jsonl`: real data on the tiny model, which has no model.path,
reads the family's tiny checkpoint from the cache, named in the config and announced when written;
synthetic data and non-tiny models keep model.path unset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dhp.config.data_shortcuts import CACHE_ENV, tiny_checkpoint_dir
from dhp.errors import ConfigError
from dhp.models.tiny_cache import ensure_tiny_checkpoint
from dhp.validation import load_config

pytestmark = pytest.mark.unit
DEMO = Path(__file__).resolve().parents[3] / "dhp" / "data_assets" / "demo"


def _my_jsonl(tmp_path: Path) -> Path:
    """LLaMA-Factory's mllm_demo layout as a user writes it: one record a line, absolute image paths."""
    my = tmp_path / "my.jsonl"
    rows = json.loads((DEMO / "mllm_demo.json").read_text())
    my.write_text(
        "".join(json.dumps({**r, "images": [str(DEMO / p) for p in r["images"]]}) + "\n" for r in rows)
    )
    return my


def test_real_data_on_tiny_vlm_names_and_writes_the_tiny_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    overrides = [f"data.path={_my_jsonl(tmp_path)}", "train.steps=2"]
    cfg = load_config("tiny_vlm", overrides)  # validates before the directory exists: the run writes it
    want = Path(cfg.model.path)
    assert want == tiny_checkpoint_dir(cfg.model) and not want.exists()
    assert want.parent == tmp_path / "cache" / "tiny_checkpoints" and want.name.startswith("qwen2_5_vl-")
    # the recipe's stated real-image limit: one photo (<= 64 patches) fits the vision seq_len of 256
    assert (cfg.data.max_pixels, cfg.modules.vision.seq_len, cfg.data.kind) == (12544, 256, "llava")

    said: list[str] = []
    assert ensure_tiny_checkpoint(cfg.model, say=said.append) == want
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "preprocessor_config.json"} <= {
        p.name for p in want.iterdir()
    }
    assert (
        len(said) == 1
        and f"model.path unset: using the tiny random qwen2_5_vl checkpoint at {want}" in said[0]
    )
    assert [p.name for p in want.parent.iterdir()] == [want.name]  # no temporary sibling left
    again = load_config("tiny_vlm", overrides)  # now validated against the written config.json
    assert again.model.path == str(want)


def test_synthetic_data_and_other_models_keep_model_path_unset(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert load_config("tiny_vlm").model.path is None  # synthetic: seeded random init as before
    own = load_config("tiny_vlm", [f"data.path={_my_jsonl(tmp_path)}", "model.path=null"])
    assert own.model.path is not None  # null is the default: real data still needs a tokenizer
    with pytest.raises(ConfigError) as info:  # a model without a tiny checkpoint: real data needs its own
        load_config("qwen_vl_7b", [f"data.path={_my_jsonl(tmp_path)}"])
    (issue,) = info.value.issues
    assert (issue.path, issue.value) == ("model.path", None) and "set model.path=DIR" in issue.fix
    real = load_config("qwen_vl_7b")
    assert real.model.path is None and not real.model.tiny
    assert ensure_tiny_checkpoint(real.model, say=pytest.fail) is None
    assert not (tmp_path / "cache").exists()
