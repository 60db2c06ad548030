"""One space of valid plans: the rule validation, the ``--auto`` search and ``parallelize`` share.

The family declares its modules' parallel axes once, torch-free (``arch.module_axes``, read by
validation and the search); the runtime plan (``ModuleParallelPlan``, read by ``parallelize``) carries
the same facts (``dhp.models.axes.runtime_plan``). They must agree, or the planner would offer what the
runtime refuses.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from dhp.config.plan_space import declared_axes, module_problems, placement_problems
from dhp.layout import ParallelLayout
from dhp.models import get_family
from dhp.models.arch import ModuleAxes
from dhp.models.registry import family_names, get_arch
from dhp.parallel.compose import module_axes
from dhp.validation import load_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("family", family_names())
@pytest.mark.parametrize("name", ["vision", "llm"])
def test_declared_axes_equal_the_runtime_plan(family: str, name: str) -> None:
    fam = get_family(family)
    model = fam.tiny_model_config()
    declared = declared_axes(get_arch(family), name, OmegaConf.structured(model))
    runtime = module_axes(fam.parallel_plan(name, fam.hf_config(model)))
    assert (declared.tp, declared.sp, declared.tp_sequence_parallel) == (
        runtime.tp,
        runtime.sp,
        runtime.tp_sequence_parallel,
    )
    # the runtime plan's sizes are the declaration's, read from the transformers config
    assert sorted(declared.tp_divides.values()) == sorted(runtime.tp_divides.values())
    assert sorted(declared.sp_divides.values()) == sorted(runtime.sp_divides.values())
    # the typed architecture's Mlp(kind="moe", experts=...) and the runtime plan's MoE blocks agree
    assert declared.experts == runtime.experts
    # pipeline stages: the LLM's decoder layers, the encoders none
    assert (declared.pp, declared.pp_layers) == (runtime.pp, runtime.pp_layers)
    assert declared.pp == (name == "llm") and (declared.pp_layers > 0) == declared.pp


AXES = ModuleAxes(tp=True, sp=False, tp_sequence_parallel=False, tp_divides={"model.llm.num_kv_heads": 2})


def _problems(gpn: int | None = 8, ac: object = "off", mp: str = "fp32", **deg) -> list[str]:
    par = ParallelLayout(**deg)
    gpus = par.dp * par.fsdp * par.sp * par.tp
    items = module_problems("llm", gpus=gpus, layout=par, axes=AXES, gpus_per_node=gpn,
                            activation_checkpointing=ac, mixed_precision=mp)  # fmt: skip
    return [f"{i.path}: {i.rule}" for i in items]


def test_module_rule_names_every_reason() -> None:
    assert _problems(tp=2, fsdp=2) == []
    assert any("does not support sp" in p for p in _problems(sp=2))
    assert any("mutually exclusive" in p for p in _problems(sp=2, tp=2))
    assert any("num_kv_heads=2 is not divisible by tp=4" in p for p in _problems(tp=4))
    assert any("inside one node" in p for p in _problems(gpn=2, tp=2, dp=2) + _problems(gpn=4, tp=8))
    assert any("no sequence parallelism inside TP" in p for p in _problems(tp=2, sequence_parallel=True))
    assert any("ZeRO-1 and FSDP" in p for p in _problems(fsdp=2, zero=1))
    assert any("activation_checkpointing" in p for p in _problems(ac="sometimes", dp=2))


def test_ep_rule_folds_over_token_ranks_and_needs_moe_blocks() -> None:
    moe = ModuleAxes(tp=True, sp=True, tp_sequence_parallel=True, experts=8)

    def ep_problems(axes: ModuleAxes = moe, **deg) -> list[str]:
        par = ParallelLayout(**deg)
        gpus = par.dp * par.fsdp * par.sp * par.tp
        items = module_problems("llm", gpus=gpus, layout=par, axes=axes, gpus_per_node=8,
                                activation_checkpointing="off", mixed_precision="fp32")  # fmt: skip
        return [f"{i.path}: {i.rule}; fix: {i.fix}" for i in items]

    assert ep_problems(dp=2, ep=2) == []
    assert ep_problems(fsdp=2, sp=2, ep=4) == []  # folded over fsdp x sp
    assert ep_problems(dp=2, tp=2, ep=2) == []  # tp is not folded: each tp index has its own EP group
    (p,) = ep_problems(dp=2, tp=2, ep=4)
    assert "modules.llm.parallel.ep: the EP group is folded from the dp x fsdp x sp ranks (2)" in p
    assert "divisors of 2" in p
    (p,) = ep_problems(dp=2, sp=3, ep=3)
    assert "number of experts=8 is not divisible by ep=3" in p
    (p,) = ep_problems(axes=AXES, dp=2, ep=2)
    assert "no mixture-of-experts blocks" in p and "set ep=1" in p
    assert any("sequence_parallel" in p for p in ep_problems(dp=2, tp=2, ep=2, sequence_parallel=True))
    assert any("must be >= 1" in p for p in ep_problems(dp=2, ep=0))
    assert any("mixed_precision" in p for p in _problems(mp="fp8", dp=2))
    # several problems at once, each with its own key path
    assert len(_problems(sp=2, tp=2, mp="fp8", ac="x")) >= 4


def test_expert_tp_and_expert_fsdp_rules() -> None:
    moe = ModuleAxes(tp=True, sp=True, tp_sequence_parallel=True, experts=8)

    def problems(axes: ModuleAxes = moe, **deg) -> list[str]:
        par = ParallelLayout(**deg)
        items = module_problems("llm", gpus=par.world_size, layout=par, axes=axes, gpus_per_node=8,
                                activation_checkpointing="off", mixed_precision="fp32")  # fmt: skip
        return [f"{i.path}: {i.rule}; fix: {i.fix}" for i in items]

    assert problems(dp=2, tp=2, ep=2, etp=2) == []  # 8 experts over ep x etp = 4 ranks
    assert problems(tp=2, etp=2) == []  # the TP group alone cuts the experts
    assert problems(dp=2, expert_fsdp=True) == [] and problems(fsdp=4, ep=2, expert_fsdp=True) == []
    (p,) = problems(dp=2, tp=4, etp=2)
    assert p.startswith("modules.llm.parallel.etp:") and "must be 1 or tp=4" in p and "etp=4" in p
    (p,) = problems(tp=2, etp=2, sequence_parallel=True)
    assert "sequence_parallel" in p and "etp > 1" in p
    (p,) = problems(dp=2, ep=2, expert_fsdp=True)
    assert p.startswith("modules.llm.parallel.expert_fsdp:") and "/ ep = 1)" in p and "edp > 1" in p
    (p,) = problems(
        tp=8, ep=1, etp=8, axes=ModuleAxes(tp=True, sp=True, tp_sequence_parallel=True, experts=4)
    )
    assert "number of experts=4 is not divisible by ep x etp = 1 x 8" in p
    dense = problems(axes=AXES, tp=2, etp=2) + problems(axes=AXES, dp=2, expert_fsdp=True)
    assert len(dense) == 2 and all("no mixture-of-experts blocks" in p for p in dense)


def test_placement_rule() -> None:
    ok = placement_problems({"vision": 4, "llm": 4}, {"vision": 2, "llm": 4}, placement="collocated",
                            handoff="auto", device="cpu", total_gpus=4)  # fmt: skip
    assert ok == []
    bad = placement_problems({"vision": 4, "llm": 2}, {"vision": 3, "llm": 2}, placement="collocated",
                             handoff="cuda_ipc", device="cpu", total_gpus=4)  # fmt: skip
    rules = " | ".join(i.rule for i in bad)
    assert "share one GPU set" in rules and "N:M routing" in rules and bad[-2].path == "handoff"


def test_vision_fsdp_x_sp_is_in_the_space_and_validates() -> None:
    """Vision FSDP x SP trains exactly (tests/parity/test_vision_sp.py), so it is offered and valid."""
    cfg = load_config(
        "tiny_vlm",
        ["modules.vision.gpus=4", "modules.vision.parallel.fsdp=2", "modules.vision.parallel.sp=2",
         "modules.llm.gpus=4", "modules.llm.parallel.dp=2"],
    )  # fmt: skip
    assert cfg.modules.vision.parallel.fsdp == 2
