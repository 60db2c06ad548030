"""Planner layout: groups, GPU assignment, Ray bundles and routing, from real recipes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dhp.errors import PlanError
from dhp.layout import ParallelLayout
from dhp.plan import compile_plan
from dhp.plan.placement import assign_gpus, routing
from dhp.validation import load_config

pytestmark = pytest.mark.unit


def _tp_groups_in_one_node(group) -> bool:
    tp = group.mesh.get("tp", 1)
    for start in range(0, group.world_size, tp):
        if len({r.node for r in group.ranks[start : start + tp]}) != 1:
            return False
    return True


@pytest.mark.slow
def test_planner_imports_no_ray_or_process_groups() -> None:
    code = (
        "import sys; from dhp.validation import load_config; from dhp.plan import compile_plan;"
        "compile_plan(load_config('qwen_vl_72b', []));"
        "import dhp.plan.search, dhp.plan.calibrate, dhp.plan.auto;"
        "dhp.plan.search.auto_plan(load_config('qwen_vl_7b', []), set(), top=1);"
        "bad = [m for m in ('ray', 'torch.distributed', 'torch') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_collocated_headline() -> None:
    plan = compile_plan(load_config("qwen_vl_32b", []))
    assert [g.name for g in plan.groups] == ["vision", "llm"]
    vision, llm = plan.groups
    assert (vision.world_size, vision.mesh) == (8, {"sp": 8})
    assert (llm.world_size, llm.mesh) == (8, {"tp": 8})
    for g in plan.groups:
        assert [r.global_gpu for r in g.ranks] == list(range(8))
        assert all(r.gpu_fraction == 0.5 and r.node == 0 for r in g.ranks)
    (pg,) = plan.placement_groups
    assert pg.strategy == "STRICT_PACK" and len(pg.bundles) == 8
    assert all(b == {"GPU": 1.0, "CPU": 8.0} for b in pg.bundles)  # 4 CPUs per rank, 2 ranks per GPU
    assert [d.groups for d in plan.devices] == [("vision", "llm")] * 8
    (route,) = plan.routing
    assert route.consumer_ranks == tuple(range(8)) and route.producer_ranks == tuple(range(8))


def test_disaggregated_unequal_gpu_counts() -> None:
    overrides = [
        "placement=disaggregated",
        "modules.vision.gpus=2",
        "modules.vision.parallel.sp=2",
        "modules.llm.gpus=6",
        "modules.llm.parallel.tp=2",
        "modules.llm.parallel.dp=3",
        "train.global_batch_size=6",
    ]
    plan = compile_plan(load_config("qwen_vl_7b", [*overrides, "modules.vision.parallel.dp=1"]))
    vision, llm = plan.group("vision"), plan.group("llm")
    assert [r.global_gpu for r in vision.ranks] == [0, 1]
    assert [r.global_gpu for r in llm.ranks] == [2, 3, 4, 5, 6, 7]
    assert all(r.gpu_fraction == 1.0 for g in plan.groups for r in g.ranks)
    assert llm.mesh == {"dp": 3, "tp": 2}
    assert [r.coords for r in llm.ranks[:3]] == [
        {"pp": 0, "dp": 0, "fsdp": 0, "cp": 0, "sp": 0, "tp": 0},
        {"pp": 0, "dp": 0, "fsdp": 0, "cp": 0, "sp": 0, "tp": 1},
        {"pp": 0, "dp": 1, "fsdp": 0, "cp": 0, "sp": 0, "tp": 0},
    ]
    assert len(plan.placement_groups[0].bundles) == 8
    assert all(b == {"GPU": 1.0, "CPU": 4.0} for b in plan.placement_groups[0].bundles)
    # one encoder replica (2 SP ranks) feeds all three LLM replicas (N:M = 2:6)
    assert [(r.consumer_ranks, r.producer_ranks) for r in plan.routing] == [
        ((0, 1), (0, 1)),
        ((2, 3), (0, 1)),
        ((4, 5), (0, 1)),
    ]


def test_four_nodes() -> None:
    plan = compile_plan(load_config("qwen_vl_72b", []))
    vision, llm = plan.group("vision"), plan.group("llm")
    assert vision.mesh == {"dp": 4, "sp": 8} and llm.mesh == {"fsdp": 4, "tp": 8}
    assert [r.node for r in llm.ranks] == [n for n in range(4) for _ in range(8)]
    assert _tp_groups_in_one_node(llm)
    assert [(pg.node, len(pg.bundles)) for pg in plan.placement_groups] == [(n, 8) for n in range(4)]
    assert {(r.placement_group, r.bundle_index) for r in llm.ranks} == {
        (p, b) for p in range(4) for b in range(8)
    }
    assert [(r.consumer_ranks, r.producer_ranks) for r in plan.routing] == [
        (tuple(range(8 * n, 8 * n + 8)), tuple(range(8 * n, 8 * n + 8))) for n in range(4)
    ]


def test_tp_group_moved_to_next_node_instead_of_crossing() -> None:
    # vision on GPUs 0-1 of node 0; a TP=8 LLM placed naively on GPUs 2-9 would cross into node 1
    overrides = [
        "cluster=h100_2x8",
        "placement=disaggregated",
        "modules.vision.gpus=2",
        "modules.vision.parallel.sp=2",
        "modules.vision.parallel.zero=0",
    ]
    plan = compile_plan(load_config("qwen_vl_32b", overrides))
    llm = plan.group("llm")
    assert [r.global_gpu for r in llm.ranks] == list(range(8, 16))
    assert _tp_groups_in_one_node(llm)


def test_tp_that_cannot_stay_in_a_node_is_a_plan_error() -> None:
    groups = {
        "vision": ParallelLayout.from_config({"dp": 5, "fsdp": 1, "sp": 1, "tp": 1}),
        "llm": ParallelLayout.from_config({"dp": 3, "fsdp": 1, "sp": 1, "tp": 4}),
    }
    with pytest.raises(PlanError, match="must stay inside one node"):
        assign_gpus(groups, placement="disaggregated", nodes=2, gpus_per_node=8)


def test_routing_more_encoder_replicas_than_llm() -> None:
    vision = ParallelLayout.from_config({"dp": 4, "fsdp": 1, "sp": 2, "tp": 1})
    llm = ParallelLayout.from_config({"dp": 2, "fsdp": 1, "sp": 1, "tp": 4})
    routes = routing(vision, llm)
    assert [r.producer_replicas for r in routes] == [(0, 1), (2, 3)]
    assert routes[1].producer_ranks == (4, 5, 6, 7) and routes[1].consumer_ranks == (4, 5, 6, 7)


def test_cpu_cluster_bundles_are_fractional_cpus() -> None:
    plan = compile_plan(load_config("tiny_vlm", []))
    (pg,) = plan.placement_groups
    assert [dict(b) for b in pg.bundles] == [{"CPU": 0.5}, {"CPU": 0.5}]


def test_json_document_keys() -> None:
    doc = json.loads(compile_plan(load_config("qwen_vl_32b", [])).to_json_str())
    assert {"groups", "placement", "device_memory_bytes", "fits", "bundles", "routing"} <= doc.keys()
    for group in doc["groups"]:
        assert {"name", "world_size", "mesh", "ranks"} <= group.keys()
        for rank in group["ranks"]:
            assert {"rank", "node", "gpu", "gpu_fraction", "memory"} <= rank.keys()
            mem = rank["memory"]
            assert mem["total"] == max(mem["phases"].values())  # peak over the phases, not a sum
            assert mem["peak_phase"] in mem["phases"]
    for device in doc["devices"]:
        assert device["total"] == sum(device["peak_terms"].values()) == max(device["by_phase"].values())
    assert {"step_time_s", "vision_tokens_per_s", "text_tokens_per_s", "mfu", "modules"} <= doc[
        "estimate"
    ].keys()
    for module in doc["estimate"]["modules"].values():
        assert {"fwd_s", "bwd_s", "comm_s", "optim_s"} <= module.keys()


def test_compile_is_deterministic() -> None:
    cfg = load_config("qwen_vl_72b", [])
    assert compile_plan(cfg).to_json() == compile_plan(cfg).to_json()


def test_oom_advice_names_the_biggest_consumer() -> None:
    from dhp.plan.advice import oom_advice

    assert oom_advice(compile_plan(load_config("qwen_vl_32b", []))) == []
    long_images = [
        "modules.vision.seq_len=65536",
        "data.synthetic.patches=16384",
        "modules.llm.seq_len=16896",
        "modules.vision.activation_checkpointing=off",
    ]
    lines = oom_advice(compile_plan(load_config("qwen_vl_32b_zero3", long_images)))
    assert (
        "over by" in lines[0] and "(llm_bwd)" in lines[0]
    )  # LLM backward while the encoder holds its saved activations
    assert "vision activations" in lines[1] and "llm optimizer" in lines[2]
    assert "vision activations" in lines[1] and "modules.vision.parallel.sp" in lines[1]
    line = lines[1]
    assert "vision activations" in line and "modules.vision.parallel.sp" in line
