"""Pipeline parallelism's rules: each bad config raises ConfigError naming the key, the rule and a fix.

The rule is one place (``dhp.config.plan_space``): the degrees and the schedule against each other and
the module's declared axes (``ModuleAxes.pp`` / ``pp_layers`` / ``pp_refused``), and the step's
micro-batches against what torch.distributed.pipelining's schedule accepts.
"""

from __future__ import annotations

import pytest

from dhp.config.plan_space import pipeline_micro_batches
from dhp.errors import ConfigError
from dhp.layout import ParallelLayout
from dhp.validation import load_config

pytestmark = pytest.mark.unit

#: the tiny Qwen2.5-VL's LLM (2 decoder layers) on 2 pipeline stages: valid
PP2 = [
    "modules.llm.parallel.tp=1",
    "modules.llm.parallel.sequence_parallel=false",
    "modules.llm.parallel.pp=2",
]

# (recipe, overrides, key path that must be named, words of the rule, words of the fix)
BAD = [
    ("tiny_vlm", [*PP2, "modules.llm.parallel.pp=0", "modules.llm.gpus=0"], "modules.llm.parallel.pp",
     "must be >= 1", "use 1"),
    ("tiny_vlm", [*PP2, "modules.llm.gpus=4"], "modules.llm.gpus", "pp*dp*fsdp*cp*sp*tp", "gpus=2"),
    ("tiny_vlm", ["modules.vision.parallel.sp=1", "modules.vision.parallel.pp=2"],
     "modules.vision.parallel.pp", "does not support pipeline stages", "pp=1"),
    ("tiny_vlm", [*PP2, "modules.llm.parallel.pp_virtual=0"], "modules.llm.parallel.pp_virtual",
     "must be >= 1", "use 1"),
    ("tiny_vlm", [*PP2, "modules.llm.parallel.pp_schedule=looped"], "modules.llm.parallel.pp_schedule",
     "1f1b", ""),
    ("tiny_vlm", [*PP2, "modules.llm.parallel.pp_schedule=interleaved_1f1b"],
     "modules.llm.parallel.pp_virtual", "needs pp_virtual >= 2", "pp_virtual=2"),
    ("tiny_vlm", [*PP2, "modules.llm.parallel.pp_virtual=2"], "modules.llm.parallel.pp_virtual",
     "needs pp_virtual=1", "pp_virtual=1"),
    ("tiny_vlm", [*PP2, "modules.llm.parallel.pp_virtual=2", "modules.llm.parallel.pp_schedule=zero_bubble"],
     "modules.llm.parallel.pp", "4 stages, but the module has 2 decoder layers", "<= 2"),
    ("tiny_vlm", [*PP2, "modules.llm.parallel.cp=2", "modules.llm.gpus=4", "modules.vision.gpus=4",
                  "modules.vision.parallel.sp=4", "placement=disaggregated", "cluster.gpus_per_node=8"],
     "modules.llm.parallel.cp", "context parallelism", "cp=1"),
    ("tiny_vlm", [*PP2, "modules.llm.parallel.sequence_parallel=true", "modules.llm.parallel.tp=2",
                  "modules.llm.gpus=4", "modules.vision.gpus=4", "modules.vision.parallel.sp=4",
                  "cluster.gpus_per_node=8"],
     "modules.llm.parallel.sequence_parallel", "pipeline stages", "sequence_parallel=false"),
    ("tiny_vlm", [*PP2, "model.llm.tie_word_embeddings=true"], "model.llm.tie_word_embeddings",
     "share one weight across stages", "pp=1"),
    ("tiny_qwen3_vl_moe", [*PP2, "modules.llm.parallel.ep=1", "modules.llm.parallel.dp=1",
                           "train.router_aux_loss=micro_batch"], "train.router_aux_loss",
     "load-balancing loss", "router_aux_loss=step"),
    ("tiny_vlm", [*PP2, "train.global_batch_size=2"], "train.global_batch_size",
     "pp_schedule=1f1b needs at least pp=2 micro-batches", "multiple of"),
    # the user's cut: one count per stage, each >= 1, summing to the layers
    ("tiny_qwen3_5", [*PP2, "modules.llm.parallel.pp_cut=[1,2]"], "modules.llm.parallel.pp_cut",
     "sum to the module's 4 layers", "pp_cut=[2, 2]"),
    ("tiny_qwen3_5", [*PP2, "modules.llm.parallel.pp_cut=[4]"], "modules.llm.parallel.pp_cut",
     "2 stages", "pp_cut=[2, 2]"),
    # zero bubble's split backward: not with selective checkpointing, FSDP2 or the expert axes
    ("tiny_qwen3_5", [*PP2, "modules.llm.parallel.pp_virtual=2", "modules.llm.parallel.pp_schedule=zero_bubble",
                      "modules.llm.activation_checkpointing=selective"],
     "modules.llm.parallel.pp_schedule", "selective", "interleaved_1f1b"),
    ("tiny_qwen3_5", [*PP2, "modules.llm.parallel.pp_virtual=2", "modules.llm.parallel.pp_schedule=zero_bubble",
                      "modules.llm.parallel.fsdp=2", "modules.llm.gpus=4", "modules.vision.gpus=4",
                      "modules.vision.parallel.dp=2"],
     "modules.llm.parallel.pp_schedule", "FSDP2", "fsdp=1"),
]  # fmt: skip


@pytest.mark.parametrize(("recipe", "overrides", "path", "rule", "fix"), BAD)
def test_bad_pipeline_config_names_key_and_fix(
    recipe: str, overrides: list[str], path: str, rule: str, fix: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides)
    matching = [i for i in info.value.issues if i.path == path]
    assert matching, f"no issue at {path}: {info.value}"
    assert any(rule in i.rule and fix in i.fix for i in matching), (
        f"rule/fix lack {rule!r}/{fix!r}: {matching}"
    )


def test_valid_pipelines_load() -> None:
    cfg = load_config("tiny_vlm", PP2)
    assert cfg.modules.llm.parallel.pp == 2
    gpipe = load_config(
        "tiny_vlm", [*PP2, "modules.llm.parallel.pp_schedule=gpipe", "train.global_batch_size=2"]
    )
    assert gpipe.modules.llm.parallel.pp_schedule == "gpipe"  # gpipe runs any micro-batch count
    # the MoE tiny LLM pipelines with its load-balancing loss (train.router_aux_loss=step)
    moe = load_config("tiny_qwen3_vl_moe", [*PP2, "modules.llm.parallel.ep=1", "modules.llm.parallel.dp=1"])
    assert moe.modules.llm.parallel.pp == 2  # the router's term over the step: each stage's share


@pytest.mark.parametrize(
    ("schedule", "v", "pp", "m", "ok"),
    [
        ("1f1b", 1, 4, 3, False),  # Schedule1F1B: n_microbatches >= stages
        ("1f1b", 1, 4, 4, True),
        ("gpipe", 1, 4, 1, True),
        ("interleaved_1f1b", 2, 4, 3, True),  # one round of 3
        ("interleaved_1f1b", 2, 4, 9, False),  # 2 rounds: 9 % 2 != 0
        ("interleaved_1f1b", 2, 4, 10, True),  # 2 rounds of 5
        ("zero_bubble", 2, 4, 9, False),
        ("zero_bubble", 2, 4, 12, True),
    ],
)
def test_micro_batch_rule_is_torchs(schedule: str, v: int, pp: int, m: int, ok: bool) -> None:
    lay = ParallelLayout(pp=pp, pp_virtual=v, pp_schedule=schedule)
    assert (pipeline_micro_batches(lay, m) is None) == ok


def test_a_users_cut_is_the_stages_cut() -> None:
    from dhp.plan.compile import compile_plan

    cfg = load_config("tiny_qwen3_5", [*PP2, "modules.llm.parallel.pp_cut=[3,1]"])
    lay = ParallelLayout.from_config(cfg.modules.llm.parallel)
    assert lay.pp_cut == (3, 1) and lay.stage_ranges(4) == [(0, 3), (3, 4)]
    assert ParallelLayout(pp=2).stage_ranges(4) == [(0, 2), (2, 4)]  # none given: the balanced cut
    assert ParallelLayout.from_config(lay.config_values()) == lay
    plan = compile_plan(cfg)
    assert plan.group("llm").stage_layers == (3, 1), plan.group("llm")
