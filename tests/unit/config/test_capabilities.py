"""A family's undeclared capability is refused before anything starts; a declared one is accepted."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dhp.errors import ConfigError, DataError
from dhp.models import get_arch, get_family
from dhp.validation import load_config

pytestmark = pytest.mark.unit


def _error_paths(recipe: str, overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as exc:
        load_config(recipe, overrides)
    return {i.path: i.rule for i in exc.value.issues}


def test_packing_is_refused_for_a_family_that_does_not_declare_it(monkeypatch) -> None:
    # every family packs today (each with its parity test); the rule is held on Qwen3-VL's declaration
    # with packing taken out
    arch = get_arch("qwen3_vl")
    monkeypatch.setattr(type(arch), "capabilities", dataclasses.replace(arch.capabilities, packing=False))
    with pytest.raises(ConfigError) as exc:
        load_config("tiny_qwen3_vl", ["data.packing=true"])
    (issue,) = [i for i in exc.value.issues if i.path == "data.packing"]
    assert "does not declare packing" in issue.rule
    assert "qwen2_5_vl" in issue.fix and "qwen3_5" in issue.fix  # the families that do


@pytest.mark.parametrize("recipe", ["tiny_qwen3_vl", "tiny_qwen3_vl_moe", "tiny_qwen3_5", "tiny_qwen3_5_moe"])
def test_the_qwen3_families_declare_packing(recipe: str) -> None:
    load_config(recipe, ["data.packing=true"])


def test_qwen3_vl_synthetic_video_is_refused() -> None:
    assert not get_arch("qwen3_vl").capabilities.video
    overrides = ["data.kind=synthetic", "data.synthetic.videos_per_sample=1"]
    issues = _error_paths("tiny_qwen3_vl", overrides)
    assert "does not declare video" in issues["data.synthetic.videos_per_sample"]


def test_a_family_that_declares_packing_and_video_is_accepted() -> None:
    caps = get_arch("qwen2_5_vl").capabilities
    assert caps.packing and caps.video
    load_config("tiny_vlm", ["data.packing=true"])
    load_config(
        "tiny_vlm",
        ["data.kind=synthetic", "data.synthetic.videos_per_sample=1", "modules.vision.seq_len=512"],
    )


def test_qwen3_vl_llm_refuses_a_video_batch_at_run_time() -> None:
    """A video record that reaches the LLM (real data, not known at plan time) is a DataError."""
    family = get_family("qwen3_vl")
    cfg = family.hf_config(family.tiny_model_config())
    llm = family.build_module("llm", cfg, device="cpu", dtype=torch.float32)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(DataError, match="declares video=False"):
        llm(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            labels=ids,
            mm_token_type_ids=torch.zeros_like(ids),
            second_per_grid_ts=torch.ones(1),
        )
