"""The LLM TP plan is data: every Linear / Embedding of the tiny LLM matches exactly one glob, every glob
matches something, and the divisibility checks name the offending dimension."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dhp.errors import PlanError
from dhp.models import get_family
from dhp.models.qwen2_5_vl.parallel import llm_tp_plan
from dhp.parallel.llm_tp import check_divides, match_plan

pytestmark = pytest.mark.unit


def test_every_linear_and_embedding_matches_exactly_one_glob() -> None:
    family = get_family("qwen2_5_vl")
    hf = family.hf_config(family.tiny_model_config())  # conf/model/tiny.yaml: 2 layers
    model = family.build_module("llm", hf, device="meta", dtype=torch.float32)  # dhp.models' LLMModule
    plan = llm_tp_plan()
    matches = match_plan(model, plan)
    sharded = {fqn: m for fqn, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    assert len(sharded) == 2 * 7 + 2  # 7 Linears per layer x 2 layers + embed_tokens + lm_head
    for fqn in sharded:
        assert len(matches[fqn]) == 1, f"{fqn} matches {matches[fqn]}"
    for fqn, globs in matches.items():
        if fqn not in sharded:
            assert globs == [], f"non-Linear {fqn} matched {globs}"
    used = {g for globs in matches.values() for g in globs}
    assert used == set(plan), f"globs that match nothing: {set(plan) - used}"


@pytest.mark.parametrize(
    ("dims", "bad"),
    [
        (
            {
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "vocab_size": 1024,
                "intermediate_size": 256,
            },
            "num_key_value_heads=2",
        ),
        (
            {
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "vocab_size": 1030,
                "intermediate_size": 256,
            },
            "vocab_size=1030",
        ),
        (
            {
                "num_attention_heads": 6,
                "num_key_value_heads": 4,
                "vocab_size": 1024,
                "intermediate_size": 256,
            },
            "num_attention_heads=6",
        ),
    ],
)
def test_divisibility_is_refused_with_the_dimension_named(dims: dict, bad: str) -> None:
    with pytest.raises(PlanError, match=bad):
        check_divides(dims, degree=4, axis="tp", module="llm")


def test_divisible_dimensions_pass() -> None:
    check_divides(
        {"num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1024, "intermediate_size": 256},
        degree=4,
        axis="tp",
        module="llm",
    )
