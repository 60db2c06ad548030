"""``dhp verify`` of the MoE families' router term: the same step at every micro-batch cut and data-parallel
degree is transformers' own model on the step's batch in one call.

Each MoE recipe runs from a tiny checkpoint whose routers are skewed (``dhp.models.testing.skew_routers_``:
routing decisive and uneven, so the load-balancing term is far above rounding),
through ``verify_plan`` (the function behind ``dhp verify``) on the module's shared local Ray, at:

- 2 micro-batches per replica at LLM dp=2 (the recipe's plan, ``train.micro_batch_size=1``): the runtime's
  statistics pass, then every micro-batch's term over the step's counts;
- 4 micro-batches on one LLM rank (disaggregated, vision SP=2 into it);
- Qwen3-VL-MoE on 4 + 4 ranks: 1 micro-batch per replica at LLM dp=4 with ep=2, the forward's own
  all-reduce (both families at dp=4: ``tests/parity/test_router_step.py``, slow).

The reference is ``...ForConditionalGeneration`` on the step's 4 samples in one call, its own ``loss``
(mean CE + coef x ``load_balancing_loss_func``), sharing no loss code with the plan; the runs also agree
with each other (the step's loss does not depend on the cut). Then the mutant: the same 2-micro-batch plan
with the statistics pass taken away (each micro-batch's term over its own tokens, the definition before
the step's) must FAIL, and ``train.router_aux_loss=micro_batch`` (that definition by choice) fails with the
reason named.

Tolerances are verify's own: loss and grad norm within 1e-5 relative, every gradient and every
parameter after the update within 1e-4 absolute (fp32).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from rich.console import Console
from transformers import AutoTokenizer

from dhp.models import get_family
from dhp.models.qwen2_5_vl.processor import QWEN_CHAT_TEMPLATE
from dhp.models.testing import skew_routers_
from dhp.models.tiny import make_tiny_checkpoint
from dhp.runtime.loop.driver import Trainer
from dhp.runtime.verify.compare import VerifyReport, render_report, verify_plan
from dhp.validation import load_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RECIPES = ("tiny_qwen3_vl_moe", "tiny_qwen3_5_moe")
#: the family name that matches each tiny checkpoint's ``model_type`` (the MoE flavour's own name)
FAMILY = {"tiny_qwen3_vl_moe": "qwen3_vl_moe", "tiny_qwen3_5_moe": "qwen3_5_moe"}
ONE_LLM_RANK = ("placement=disaggregated", "modules.llm.gpus=1", "modules.llm.parallel.dp=1")
ONE_LLM_RANK += ("modules.llm.parallel.ep=1",)
DP4 = ("modules.vision.gpus=4", "modules.vision.parallel.dp=2", "modules.llm.gpus=4")
DP4 += ("modules.llm.parallel.dp=4", "train.micro_batch_size=1")


@pytest.fixture(scope="module")
def skewed(tmp_path_factory) -> dict[str, Path]:
    """Per MoE recipe, a tiny checkpoint of its own numbers with skewed routers."""
    out = {}
    for recipe in RECIPES:
        cfg = load_config(recipe, [])
        path = make_tiny_checkpoint(tmp_path_factory.mktemp(recipe), model_cfg=cfg.model, seed=0)
        family = get_family(FAMILY[recipe])
        torch.manual_seed(0)
        model = family.reference_model(family.hf_config(cfg.model))
        assert skew_routers_(dict(model.named_parameters()), cfg.model.llm.hidden_size) >= 2
        # the weights in transformers' own (fused-experts) layout: dhp reads that layout for every MoE
        # family, the released per-expert one only for Qwen3-VL-MoE
        model.save_pretrained(path, save_original_format=False)
        # the data loader reads a model directory's tokenizer, which must carry a chat template (the
        # tiny Qwen3-style directories are written without one)
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.chat_template = QWEN_CHAT_TEMPLATE
        tokenizer.save_pretrained(path)
        out[recipe] = path
    return out


def _verify(recipe: str, path: Path, *overrides: str) -> tuple[VerifyReport, str]:
    """``dhp verify conf=RECIPE model.path=PATH steps=1 *overrides`` in this process: (report, its text)."""
    given = [f"model.path={path}", f"model.family={FAMILY[recipe]}", *overrides]
    report = verify_plan(load_config(recipe, given), steps=1)
    console = Console(record=True, width=200, file=io.StringIO())
    render_report(report, console=console)
    return report, console.export_text()


def _cut(recipe: str, skewed: dict[str, Path], overrides: tuple[str, ...]) -> float:
    report, text = _verify(recipe, skewed[recipe], *overrides)
    assert report.passed and len(report.steps) == 1, text
    assert "on the step's 4 samples in one call; loss = mean CE + " in text
    assert "load_balancing_loss_func" in text, text
    return report.steps[0].loss


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_cut_of_the_step_is_hf_on_the_step(ray_local, skewed, recipe) -> None:
    two = _cut(recipe, skewed, ("train.micro_batch_size=1",))  # dp=2 x 2 micro-batches
    four = _cut(recipe, skewed, (*ONE_LLM_RANK, "train.micro_batch_size=1"))  # 1 rank x 4 micro-batches
    assert abs(two - four) <= 1e-5 * abs(four), (two, four)


def test_one_micro_batch_at_dp4_is_hf_on_the_step(ray_local, skewed) -> None:
    # the forward's own all-reduce over 4 replicas (no statistics pass); both families at dp=4 at the
    # model level: tests/parity/test_router_step.py (slow)
    _cut(RECIPES[0], skewed, DP4)


def test_the_per_micro_batch_router_loss_fails_verify(ray_local, skewed, monkeypatch) -> None:
    recipe = RECIPES[0]
    # the definition by choice: refused by name
    report, text = _verify(
        recipe, skewed[recipe], "train.micro_batch_size=1", "train.router_aux_loss=micro_batch"
    )
    assert not report.passed and "the plan's definition differs" in text, text
    assert "train.router_aux_loss=micro_batch with 2 micro-batches per LLM replica" in text, text
    # the mutant: the default (step) config, the statistics pass taken away
    monkeypatch.setattr(Trainer, "_statistics_pass", lambda self, data: False)
    report, text = _verify(recipe, skewed[recipe], "train.micro_batch_size=1")
    assert not report.passed and not report.definition_differs, text
    s = report.steps[0]
    assert s.loss_rel_diff > 10 * report.loss_rtol and s.grad_max_abs_diff["llm"] > report.grad_atol, text
    assert "FAIL" in text
