"""The real runtime under ``bf16_master_fp32``: Ray actor groups, the object store carrying bf16 rows both
ways, the driver's step over several micro-batches, against transformers' fp32 model.

Each tiny recipe runs with ``modules.{vision,llm}.mixed_precision=bf16_master_fp32`` for one step with
``collect_grads``; the reference is ``dhp verify``'s (``ReferenceModel``: the family's untouched
transformers model in fp32, started from the plan's own initial weights, which the plan holds in fp32,
fed the same micro-batches and normalised by the same label-token count). ``dhp verify`` itself
stays fp32-only (it compares to 1e-5 / 1e-4); here the bounds are the bf16 tier's against fp32
(tests/parity/test_bf16.py, relative in the norm sense): the loss 5e-4, each module's whole gradient
5e-2, every single gradient 0.25, and the plan must differ from fp32 somewhere by more than 1e-3 (bf16
really ran). Plans: tiny_vlm (vision SP=2 + LLM TP=2 with SP inside TP) and tiny_qwen3_vl_moe (vision
SP=2, DeepStack edges, LLM DP=2 x EP=2), both fsdp=1: the unit cast.
"""

from __future__ import annotations

import pytest
import torch

from dhp.data import build_run_loader
from dhp.plan import compile_plan
from dhp.runtime.loop.driver import Trainer
from dhp.runtime.verify.compare import ReferenceModel
from dhp.validation import load_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LOSS, MODULE, TENSOR = 5e-4, 5e-2, 0.25
POLICY = [f"modules.{m}.mixed_precision=bf16_master_fp32" for m in ("vision", "llm")]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("recipe", ["tiny_vlm", "tiny_qwen3_vl_moe"])
def test_runtime_step_under_master_weights_matches_fp32(ray_local, recipe: str) -> None:
    cfg = load_config(recipe, [*POLICY, "train.micro_batch_size=1", "train.global_batch_size=4"])
    plan = compile_plan(cfg)
    loader = build_run_loader(cfg, plan.layouts)
    trainer = Trainer(cfg, plan)
    try:
        ref = ReferenceModel(
            model=cfg.model, modules=dict(cfg.modules), train=cfg.train, initial=trainer.full_state_dict()
        )
        data = next(loader)
        assert len(data.micro_batches) > 1  # fp32 gradient accumulation over micro-batches
        res = trainer.step(data, lr=cfg.train.lr, collect_grads=True)
        ref_loss, _, ref_grads = ref.step(data, lr=cfg.train.lr)
    finally:
        trainer.close()
    assert abs(res.loss - ref_loss) / abs(ref_loss) <= LOSS, (res.loss, ref_loss)
    worst = 0.0
    for module, want in ref_grads.items():
        got = res.grads[module]
        assert set(got) == set(want), set(got) ^ set(want)
        flat = _rel(
            torch.cat([got[k].flatten() for k in sorted(want)]),
            torch.cat([want[k].flatten() for k in sorted(want)]),
        )
        assert flat <= MODULE, f"{recipe}: module {module}'s gradients {flat:.2e}"
        for k, w in want.items():
            e = _rel(got[k], w)
            worst = max(worst, e)
            assert e <= TENSOR, f"{recipe}: grad {module}.{k} {e:.2e}"
    print(f"\n{recipe}: loss {abs(res.loss - ref_loss) / abs(ref_loss):.1e}, worst gradient {worst:.1e}")
    assert worst > 1e-3, "no bf16 rounding observed"
