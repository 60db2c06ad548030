"""Validation of a fine-tune's length, schedule, evaluation and text settings: every problem at once,
each naming its key, value, rule and fix."""

from __future__ import annotations

import pytest

from dhp.errors import ConfigError
from dhp.validation import load_config

pytestmark = pytest.mark.unit


def _issues(*overrides: str, recipe: str = "tiny_vlm") -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        load_config(recipe, list(overrides))
    return {i.path: str(i) for i in err.value.issues}


def test_steps_and_epochs_are_one_or_the_other():
    got = _issues("train.epochs=2")  # tiny_vlm's preset sets train.steps=20
    assert "train.steps=20 is set too: a run's length is one of them" in got["train.epochs"]
    assert "train.steps=0 to train 2 epochs" in got["train.epochs"]
    got = _issues("train.steps=0")
    assert "the run has no length" in got["train.steps"]
    cfg = load_config("tiny_vlm", ["train.steps=0", "train.epochs=1.5", "train.warmup_steps=50"])
    assert cfg.train.epochs == 1.5  # an epochs run's warmup is checked once its data is open


def test_schedule_keys_all_reported_in_one_pass():
    got = _issues(
        "train.lr_schedule=step",
        "train.resume_horizon=later",
        "train.warmup_ratio=0.1",  # beside train.warmup_steps=2
        "train.lr_schedule=wsd",
        "train.decay_ratio=0",
    )
    assert set(got) >= {"train.resume_horizon", "train.warmup_ratio", "train.decay_ratio"}
    assert "train.warmup_steps=2 is set too" in got["train.warmup_ratio"]
    assert "unknown value" in _issues("train.lr_schedule=step")["train.lr_schedule"]


def test_evaluation_rules():
    got = _issues("train.eval_every=5", "train.keep_best=true")
    assert "needs evaluation data" in got["train.eval_every"] and "train.keep_best" in got
    got = _issues("data.eval.split=0.1", "data.eval.path=val.json")
    assert "data.eval.path=val.json is set too" in got["data.eval.split"]
    assert "synthetic training data has no tokenizer" in got["data.eval.path"]
    got = _issues("data.eval.split=0.1", "data.eval.batch_size=3")  # 1 LLM replica x micro-batch 2
    assert "must be a multiple of micro_batch_size*llm replicas = 2" in got["data.eval.batch_size"]
    assert "must be in [0, 1)" in _issues("data.eval.split=1.5")["data.eval.split"]
    assert load_config("tiny_vlm", ["data.eval.split=0.1", "train.eval_every=5", "train.keep_best=true"])


def test_chat_template_and_loss_mask_names():
    got = _issues("data.chat_template=vicuna", "data.train_on=users")
    assert "known: checkpoint, chatml, qwen2_vl, or a path ending in .jinja" in got["data.chat_template"]
    assert "unknown value; allowed: assistant, all" in got["data.train_on"]
    assert load_config("tiny_vlm", ["data.chat_template=/templates/mine.jinja"])  # read when data opens


def test_sft_presets_need_data_and_say_how():
    from dhp.config.loader import compose_run

    got = _issues("train=sft", "data=sft", recipe="qwen_vl_7b")
    assert "give your data with data.path=FILE" in got["data.datasets"]
    cfg = compose_run("qwen_vl_7b", ["train=sft", "data=sft", "data.path=my.json"])
    assert (cfg.train.steps, cfg.train.epochs, cfg.train.keep_best, cfg.data.eval.split) == (0, 3, True, 0.02)
    assert (cfg.train.lr_schedule, cfg.train.warmup_ratio, cfg.data.train_on) == ("cosine", 0.03, "assistant")
