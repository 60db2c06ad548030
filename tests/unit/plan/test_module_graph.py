"""The planner's module graph (``dhp.plan.graph``): read off every family's typed architecture and off
a throwaway one with two encoders; the step schedule on that graph; and no module name used as a
role in the planner's code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dhp.errors import PlanError
from dhp.models.arch import Architecture, Attention, Block, Capabilities, Mlp, ModuleArch, ParamCount
from dhp.models.registry import family_names, get_arch
from dhp.plan.graph import ModuleGraph, module_graph, run_graph
from dhp.plan.schedule import schedule
from dhp.validation import load_config

pytestmark = pytest.mark.unit

PLAN = Path(__file__).resolve().parents[3] / "dhp" / "plan"

#: a recipe whose model each family can plan (an alias: its folder's recipe, planned as the alias)
FAMILY_RECIPES = {
    "qwen2_5_vl": "tiny_vlm",
    "qwen3_vl": "tiny_qwen3_vl",
    "qwen3_vl_moe": "tiny_qwen3_vl_moe",
    "qwen3_5": "tiny_qwen3_5",
    "qwen3_5_moe": "tiny_qwen3_5_moe",
    "qwen2_5_omni": "tiny_qwen2_5_omni",
    "qwen3_omni": "tiny_qwen3_omni",
}
#: the producers of a family's graph, when they are not the one vision encoder
PRODUCERS = {"qwen2_5_omni": ("audio", "vision"), "qwen3_omni": ("audio", "vision")}


@pytest.mark.parametrize("family", sorted(FAMILY_RECIPES))
def test_every_family_has_one_loss_module_fed_by_its_encoder(family: str) -> None:
    model = load_config(FAMILY_RECIPES[family], []).model
    graph = module_graph(get_arch(family).architecture(model))
    producers = PRODUCERS.get(family, ("vision",))
    assert graph == ModuleGraph(consumer="llm", producers=producers)
    if family in PRODUCERS:  # several encoders: each one's forward, backwards in reverse order
        assert graph.phases()[: len(producers)] == tuple(f"{p}_fwd" for p in producers)
        bwd = graph.phases().index("handback") + 1
        assert graph.phases()[bwd : bwd + len(producers)] == tuple(f"{p}_bwd" for p in reversed(producers))
        return
    # the phase order the memory timeline has always had for an encoder + LLM
    assert graph.phases() == (
        "vision_fwd",
        "handoff",
        "llm_fwd",
        "llm_bwd",
        "handback",
        "vision_bwd",
        "grad_sync",
        "grad_norm",
        "optimizer",
    )


def test_every_registered_family_is_covered() -> None:
    assert set(family_names()) <= set(FAMILY_RECIPES), "add a recipe for the new family above"


def test_run_graph_keeps_the_producers_the_run_configures() -> None:
    cfg = load_config("tiny_vlm", [])
    assert run_graph(cfg) == ModuleGraph("llm", ("vision",))
    assert run_graph(cfg).within(["llm"]) == ModuleGraph("llm", ())


# --- a throwaway architecture: two encoders, a module that feeds nothing, the LLM declared first ----
def _module(*, inputs: tuple[str, ...] = (), outputs: tuple[str, ...] = (), vocab: int = 0) -> ModuleArch:
    block = Block(Attention(kind="full", heads=2, kv_heads=2, head_dim=8), Mlp(kind="dense", intermediate=32))
    count = ParamCount(tp_sharded=100, replicated=10)
    return ModuleArch(
        hidden=16,
        blocks=(block, block),
        params=count,
        block_params=count,
        largest_param=64,
        inputs=inputs,
        outputs=outputs,
        vocab=vocab,
    )


def _arch(**modules: ModuleArch) -> Architecture:
    return Architecture(modules=modules, capabilities=Capabilities(packing=False, video=False, tp_sharded={}))


FOUR = _arch(
    decoder=_module(inputs=("audio_embeds", "image_embeds"), vocab=1000),
    audio=_module(outputs=("audio_embeds",)),
    probe=_module(outputs=("probe_rows",)),  # an edge nobody takes: not a producer of the loss module
    image=_module(outputs=("image_embeds",)),
)


def test_graph_of_two_encoders_in_declaration_order() -> None:
    graph = module_graph(FOUR)
    assert graph.consumer == "decoder"
    assert graph.producers == ("audio", "image")
    assert graph.modules == ("audio", "image", "decoder")
    assert graph.within(["image", "decoder"]).producers == ("image",)
    assert graph.phases() == (
        "audio_fwd",
        "image_fwd",
        "handoff",
        "decoder_fwd",
        "decoder_bwd",
        "handback",
        "image_bwd",
        "audio_bwd",
        "grad_sync",
        "grad_norm",
        "optimizer",
    )


def test_graph_needs_exactly_one_loss_module() -> None:
    with pytest.raises(PlanError, match="2 loss modules"):
        module_graph(_arch(a=_module(vocab=10), b=_module(vocab=10)))
    with pytest.raises(PlanError, match="0 loss modules"):
        module_graph(_arch(a=_module(outputs=("x",)), b=_module(inputs=("x",))))


def _times(fwd: float, bwd: float, sync: float, optim: float) -> dict[str, float]:
    return {"fwd_s": fwd, "bwd_s": bwd, "grad_sync_s": sync, "optim_s": optim}


PER = {
    "audio": _times(1.0, 2.0, 0.5, 0.25),  # 3 s a micro-batch, 0.75 s finish
    "image": _times(4.0, 6.0, 0.5, 1.5),  # 10 s, 2 s
    "decoder": _times(3.0, 3.0, 0.25, 0.25),  # 6 s + 2 x 0.5 s hand-off = 7 s, 0.5 s
}


def test_collocated_producers_run_one_after_the_other() -> None:
    s = schedule("collocated", PER, graph=module_graph(FOUR), n_mb=4, handoff=0.5, dispatch=0.125)
    assert s.step_s == pytest.approx(4 * (3 + 10 + 7) + (0.75 + 2 + 0.5) + 4 * 0.125)
    assert s.bottleneck == "serial (shared GPUs)"
    assert s.idle_s == {"audio": 0.0, "image": 0.0, "decoder": 0.0}


def test_disaggregated_producers_run_side_by_side_bounded_by_the_slowest() -> None:
    s = schedule("disaggregated", PER, graph=module_graph(FOUR), n_mb=4, handoff=0.5)
    # the producers' stage is the slowest producer's (10 s), not their sum: it bounds each micro-batch,
    # the consumer's 7 s fills the pipeline once, the longest finish ends the step
    assert s.step_s == pytest.approx(4 * 10 + 7 + 2)
    assert s.bottleneck == "image"
    assert s.idle_s == pytest.approx({"audio": 49 - (4 * 3 + 0.75), "image": 49 - 42, "decoder": 49 - 28.5})
    fast = {**PER, "image": _times(1.0, 1.0, 0.5, 1.5)}  # now every producer is faster than the consumer
    s = schedule("disaggregated", fast, graph=module_graph(FOUR), n_mb=4, handoff=0.5)
    assert s.step_s == pytest.approx(4 * 7 + 3 + 2)  # the slowest producer (audio, 3 s) fills it
    assert s.bottleneck == "decoder"


def test_schedule_without_producers_is_the_consumer_alone() -> None:
    alone = {"decoder": PER["decoder"]}
    s = schedule("disaggregated", alone, graph=module_graph(FOUR), n_mb=2, handoff=0.5)
    assert s.step_s == pytest.approx(2 * 6 + 0.5)
    assert (s.bottleneck, s.idle_s) == ("decoder", {"decoder": 0.0})


# --- no module name as a role in the planner ---------------------------------------------------------
#: the planner's files that name no module: the graph says which module plays which part
DEROLED = (
    "advice.py",
    "calibrate.py",
    "compile.py",
    "estimate.py",
    "graph.py",
    "memory.py",
    "phases.py",
    "render.py",
    "schedule.py",
    "search.py",
    "types.py",
    "workload.py",
)
ROLE_NAMES = {"vision", "llm"}
#: ``workload.tokens_per_step["vision"]`` (the step's patches) is a key of the plan's JSON document,
#: written by workload.py and read by render.py, not a module's name
ALLOWED = {("workload.py", "vision"): 1, ("render.py", "vision"): 1}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def role_literals(source: str) -> list[str]:
    """The string literals of ``source`` (docstrings aside) that are a module's name."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docs
        and node.value in ROLE_NAMES
    ]


def test_role_literal_check_finds_a_module_name() -> None:
    code = 'def f(per):\n    """The vision module."""\n    return per["llm"], f"{per} vision"\n'
    assert role_literals(code) == ["llm"]


@pytest.mark.parametrize("name", DEROLED)
def test_planner_names_no_module_as_a_role(name: str) -> None:
    found = role_literals((PLAN / name).read_text(encoding="utf-8"))
    allowed = {lit: n for (f, lit), n in ALLOWED.items() if f == name}
    assert {lit: found.count(lit) for lit in set(found)} == allowed
