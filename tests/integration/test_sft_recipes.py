"""Every SFT recipe trains end to end on its tiny counterpart, as a user runs it on a real checkpoint:
``dhp train conf=sft_R smoke=true model.path=TINY data.path=F``, with TINY a tiny checkpoint in the
real layout of the recipe's family (tokenizer with its chat template, processor, safetensors) and F a
LLaMA-Factory file of real photographs. The smoke run keeps each module's strategy (SP stays SP, FSDP
stays FSDP, EP stays EP), the recipe's data and its evaluation (its presets ``train=sft data=sft``: 2 %
held out, after each of its 2 steps, the best checkpoint kept), and ``dhp export`` of the best
checkpoint loads in transformers.

A second test checks that an evaluation changes no training loss (with LoRA dropout drawing from the
RNG in every step).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import transformers
from rich.console import Console
from sft import llamafactory_file, tiny_checkpoint

from dhp.checkpoint.export import export_checkpoint
from dhp.metrics.rundir import read_run_log
from dhp.metrics.runs import read_run
from dhp.runtime.loop.train import train
from dhp.validation import load_config

pytestmark = pytest.mark.integration

SLOW = pytest.mark.slow
RECIPES = [
    "sft_qwen_vl_7b",
    "sft_qwen3_vl_8b",
    "sft_qwen3_vl_30b_a3b",  # MoE: EP, the router's load-balancing term
    "sft_qwen3_5_27b",  # hybrid linear attention
]


@pytest.fixture(scope="module")
def data_files(tmp_path_factory) -> tuple[Path, Path]:
    """(the training file: 12 photos, the eval file: 3 others' captions of the same photos)."""
    root = tmp_path_factory.mktemp("data")
    return (
        llamafactory_file(root / "train.json"),
        llamafactory_file(root / "val.json", ["coffee.png", "moon.png", "grass.png"]),
    )


def _sft(recipe: str, tiny: Path, data: Path, out: Path, *overrides: str):
    """``dhp train conf=RECIPE smoke=true model.path=TINY data.path=DATA`` here."""
    given = [f"model.path={tiny}", f"data.path={data}", f"train.output_dir={out}", *overrides]
    cfg = load_config(recipe, given, smoke=True)
    console = io.StringIO()
    result = train(cfg, console=Console(file=console, width=200))
    return result, console.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_sft_recipes_train_with_eval_on_the_tiny_counterpart_and_export(
    ray_local, tmp_path, data_files, recipe
):
    tiny = tiny_checkpoint(recipe, tmp_path / "tiny")
    result, said = _sft(recipe, tiny, data_files[0], tmp_path / "runs")
    assert sorted(result.losses) == [1, 2] and all(math.isfinite(v) for v in result.losses.values())
    assert sorted(result.evals) == [1, 2] and all(math.isfinite(v) for v in result.evals.values())
    log = read_run_log(result.run_dir / "metrics.jsonl")
    # 2 % of 12 records: the one held out, never trained on, evaluated after each step
    assert [(e["step"], e["eval_samples"]) for e in log.evals] == [(1, 1), (2, 1)]
    assert "eval after step 1: loss" in said and "train.steps=2 (" in said
    info = read_run(result.run_dir)
    assert info.status == "finished" and "eval " in info.note
    best = result.run_dir / "checkpoints" / "best"
    assert best.is_symlink() and json.loads((best.parent / "best.json").read_text())["step"] in (1, 2)
    _, out = export_checkpoint(best, out_dir=tmp_path / "hf", dtype=None, say=lambda line: None)
    arch = json.loads((out / "config.json").read_text())["architectures"][0]
    _, loading = getattr(transformers, arch).from_pretrained(str(out), output_loading_info=True)
    assert not any(loading.values()), loading  # every weight of the checkpoint, nothing missing
    own = transformers.AutoTokenizer.from_pretrained(str(tiny)).chat_template
    assert own and transformers.AutoTokenizer.from_pretrained(str(out)).chat_template == own


@SLOW
def test_evaluation_changes_no_training_loss(ray_local, tmp_path, data_files):
    """The same run with an eval file after every step and without any evaluation: every training
    loss is bit-equal. LoRA dropout 0.1 draws from every rank's RNG in each training forward, so an
    evaluation that moved a stream, left a module in eval mode or changed a weight would show."""
    train_file, val_file = data_files
    tiny = tiny_checkpoint("sft_qwen_vl_7b", tmp_path / "tiny")
    # LoRA dropout is refused under TP: the LLM sharded by FSDP instead
    fsdp = [f"modules.llm.parallel.{k}={v}" for k, v in (("tp", 1), ("dp", 1), ("fsdp", 8), ("zero", 0))]
    lora = ["lora=attn_mlp", "modules.llm.lora.dropout=0.1", *fsdp]
    with_eval, _ = _sft(
        "sft_qwen_vl_7b", tiny, train_file, tmp_path / "a", *lora,
        f"data.eval.path={val_file}", "data.eval.split=0",
    )  # fmt: skip
    without, _ = _sft(
        "sft_qwen_vl_7b", tiny, train_file, tmp_path / "b", *lora,
        "data.eval.split=0", "train.keep_best=false", "train.eval_every=0",
    )  # fmt: skip
    assert sorted(with_eval.evals) == [1, 2] and not without.evals
    assert with_eval.losses == without.losses
    rows = [r for r in read_run_log(with_eval.run_dir / "metrics.jsonl").records]
    assert [e["eval_samples"] for e in read_run_log(with_eval.run_dir / "metrics.jsonl").evals] == [3, 3]
    assert rows and with_eval.losses[2] != with_eval.losses[1]
