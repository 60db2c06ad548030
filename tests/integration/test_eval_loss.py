"""The eval loss of a real run is the no-grad loss of the held-out samples, and ``train.keep_best``
keeps the checkpoint of the lowest one (Ray, gloo, tiny_vlm, fp32).

One run of 3 steps holds out 4 of synthetic_small's 16 samples (``data.eval.split=0.25``), evaluates
after every step, checkpoints every step and keeps only the newest (``keep_last=1``) beside the best.
The eval loss after step ``s`` is recomputed here, in this process, from the exported checkpoint of
step ``s`` with transformers' own model: the token-weighted mean cross-entropy over every label token
of the eval batches the run reads (the same seed, so the same held-out samples), no gradient.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers

from dhp.checkpoint.export import export_checkpoint
from dhp.data import build_run_data
from dhp.data.packing import unpacked
from dhp.data.video import reference_visual_kwargs
from dhp.ops.cross_entropy import IGNORE_INDEX, shifted_ce_sum
from dhp.plan import compile_plan
from dhp.runtime.loop.train import train
from dhp.validation import load_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RTOL = 1e-5  # fp32: the split run's loss against the single-process model's

OVERRIDES = [
    "train.steps=3",
    "train.warmup_steps=0",
    "train.lr=3e-2",  # large enough that the eval loss rises after step 1 (CPU fp32, seeded)
    "data.eval.split=0.25",
    "train.eval_every=1",
    "train.checkpoint_every=1",
    "train.keep_last=1",
    "train.keep_best=true",
]


def _hf_model(checkpoint: Path, out: Path) -> torch.nn.Module:
    """transformers' model with the weights of ``checkpoint`` (``dhp export``)."""
    _, hf_dir = export_checkpoint(checkpoint, out_dir=out, dtype=None, say=lambda line: None)
    arch = json.loads((hf_dir / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(str(hf_dir), torch_dtype=torch.float32).eval()


@torch.no_grad()
def _eval_loss(model: torch.nn.Module, batches) -> tuple[float, int]:
    """(sum of the label tokens' cross-entropy / their count, the count) over every eval batch."""
    total, tokens = 0.0, 0
    head = model.get_output_embeddings()
    for data in batches:
        for micro in data.micro_batches:
            for b in (one for x in micro for one in unpacked(x)):
                out = model.base_model(
                    input_ids=b.input_ids,
                    attention_mask=b.attention_mask,
                    **reference_visual_kwargs(b),
                    mm_token_type_ids=b.mm_token_type_ids,
                    use_cache=False,
                )
                total += float(shifted_ce_sum(out.last_hidden_state, head.weight, b.labels, bias=head.bias))
                tokens += int((b.labels[:, 1:] != IGNORE_INDEX).sum())
    return total / tokens, tokens


#: the LLM as 2 pipeline stages: the eval's forward runs stage by stage (``pipeline.forward_only``), and
#: the checkpoint of the stages exports to one transformers model
PIPELINE = [
    "modules.llm.parallel.tp=1",
    "modules.llm.parallel.pp=2",
    "modules.llm.parallel.sequence_parallel=false",
]


@pytest.mark.parametrize("plan", [[], PIPELINE], ids=["recipe", "pp2"])
def test_eval_loss_is_the_held_out_no_grad_loss_and_the_best_is_kept(ray_local, tmp_path, plan):
    cfg = load_config("tiny_vlm", ["name=ev", f"train.output_dir={tmp_path / 'runs'}", *OVERRIDES, *plan])
    result = train(cfg)
    assert sorted(result.evals) == [1, 2, 3] and all(math.isfinite(v) for v in result.evals.values())
    ckpts = result.run_dir / "checkpoints"
    best_step = min(result.evals, key=lambda s: result.evals[s])
    assert best_step < 3  # the LR overshoots after step 1: the best is not the newest checkpoint
    best = json.loads((ckpts / "best.json").read_text())
    assert best == {"step": best_step, "eval_loss": result.evals[best_step]}
    assert (ckpts / "best").resolve() == (ckpts / f"step_{best_step:06d}").resolve()
    kept = sorted(p.name for p in ckpts.glob("step_*"))
    assert kept == sorted({f"step_{best_step:06d}", "step_000003"})  # keep_last=1, the best beside it

    _, batches = build_run_data(cfg, compile_plan(cfg).layouts)
    assert batches is not None and batches.num_samples == 4
    log = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    events = {e["step"]: e for e in log if e.get("event") == "eval"}
    for step in sorted({best_step, 3}):
        model = _hf_model(ckpts / f"step_{step:06d}", tmp_path / f"hf{step}")
        loss, tokens = _eval_loss(model, batches)
        assert events[step]["eval_tokens"] == tokens and events[step]["eval_samples"] == 4
        assert math.isclose(result.evals[step], loss, rel_tol=RTOL), (step, result.evals[step], loss)
