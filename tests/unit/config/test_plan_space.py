"""One space of valid plans: the rule validation, the ``--auto`` search and ``parallelize`` share.

The family declares its modules' parallel axes twice in data: torch-free (``arch.module_axes``, read
by validation and the search) and in the runtime plan (``ModuleParallelPlan``, read by ``parallelize``).
They must agree, or the planner would offer what the runtime refuses.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from dhp.config import load_config
from dhp.config.plan_space import module_problems, placement_problems
from dhp.config.schema import ParallelConfig
from dhp.models import get_family
from dhp.models.arch import ModuleAxes
from dhp.models.registry import family_names, get_arch
from dhp.parallel.compose import module_axes

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("family", family_names())
@pytest.mark.parametrize("name", ["vision", "llm"])
def test_declared_axes_equal_the_runtime_plan(family: str, name: str) -> None:
    fam = get_family(family)
    model = fam.tiny_model_config()
    declared = get_arch(family).module_axes(name, OmegaConf.structured(model))
    runtime = module_axes(fam.parallel_plan(name, fam.hf_config(model)))
    assert (declared.tp, declared.sp, declared.tp_sequence_parallel) == (
        runtime.tp,
        runtime.sp,
        runtime.tp_sequence_parallel,
    )
    # the runtime plan names sizes in transformers' words, the declaration by config key: same sizes
    assert sorted(declared.tp_divides.values()) == sorted(runtime.tp_divides.values())
    assert sorted(declared.sp_divides.values()) == sorted(runtime.sp_divides.values())


AXES = ModuleAxes(tp=True, sp=False, tp_sequence_parallel=False, tp_divides={"model.llm.num_kv_heads": 2})


def _problems(gpn: int | None = 8, ac: object = "off", mp: str = "fp32", **deg) -> list[str]:
    par = ParallelConfig(**deg)
    gpus = par.dp * par.fsdp * par.sp * par.tp
    items = module_problems("llm", gpus=gpus, parallel=par, axes=AXES, gpus_per_node=gpn,
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
    assert any("mixed_precision" in p for p in _problems(mp="fp8", dp=2))
    # several problems at once, each with its own key path
    assert len(_problems(sp=2, tp=2, mp="fp8", ac="x")) >= 4


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
