"""The planner on a model of four modules: three producers feeding one loss module.

A throwaway family, declared and registered only in this test, has an audio encoder and a motion
encoder (token inputs: their ``seq_len`` counts one sample's frames), an image encoder (patch rows)
and a decoder that takes all three hand-offs and computes the loss. The run config is the tiny
recipe's with these four modules. Planned from its typed architecture, the plan must: lay out the
step's phases for all of them, size each module's memory from its own declaration and add up the
modules that share a GPU, place a mixed partition (two producers on shared GPUs, the others on GPUs
of their own) on the right GPU ids with the right fractions and bundles, run sharing sets serially
and disjoint sets side by side, and let ``--auto`` search all four modules' degrees and placements.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from omegaconf import DictConfig, OmegaConf

from dhp.config.placement import parse_placement, partitions, sharing_sets
from dhp.config.plan_space import ModuleAxes, placement_problems
from dhp.errors import PlanError
from dhp.models.arch import Architecture, Attention, Capabilities, Mlp, ModuleArch, ParamCount, uniform_blocks
from dhp.models.registry import register_family, unregister_family
from dhp.plan.compile import compile_plan
from dhp.plan.graph import ModuleGraph, run_graph
from dhp.plan.phases import gpu_timeline
from dhp.plan.schedule import schedule
from dhp.plan.search import Search
from dhp.validation import load_config

pytestmark = pytest.mark.unit

FAMILY = "throwaway_four_modules"
PRODUCERS = ("audio", "image", "motion")
MODULES = (*PRODUCERS, "decoder")
HIDDEN, VOCAB = 32, 1000


def _encoder(*, edge: str, pixels: bool, hidden: int = 16, layers: int = 2) -> ModuleArch:
    attention = Attention(kind="full", heads=2, kv_heads=2, head_dim=8, causal=not pixels)
    block = ParamCount(tp_sharded=3 * hidden * hidden + 2 * hidden * 4 * hidden, replicated=4 * hidden)
    return ModuleArch(
        hidden=hidden,
        blocks=uniform_blocks(layers, attention, Mlp(kind="dense", intermediate=4 * hidden, gated=False)),
        params=ParamCount(
            tp_sharded=layers * block.tp_sharded + hidden * HIDDEN * 4, replicated=layers * block.replicated
        ),
        block_params=block,
        largest_param=hidden * HIDDEN * 4,
        outputs=(edge,),
        handoff_width=HIDDEN,
        out_width=HIDDEN,
        input_row=48 if pixels else 0,
        merge=4 if pixels else 2,
        head_macs=float(hidden * HIDDEN),
        sp_unit=4,
    )


def _decoder() -> ModuleArch:
    attention = Attention(kind="full", heads=4, kv_heads=2, head_dim=8, causal=True)
    block = ParamCount(tp_sharded=2 * HIDDEN * 32 + 2 * HIDDEN * 16 + 3 * HIDDEN * 64, replicated=2 * HIDDEN)
    return ModuleArch(
        hidden=HIDDEN,
        blocks=uniform_blocks(2, attention, Mlp(kind="dense", intermediate=64)),
        params=ParamCount(
            tp_sharded=2 * block.tp_sharded + 2 * VOCAB * HIDDEN, replicated=2 * block.replicated
        ),
        block_params=block,
        largest_param=VOCAB * HIDDEN,
        inputs=tuple(f"{p}_embeds" for p in PRODUCERS),
        head_macs=float(HIDDEN * VOCAB),
        vocab=VOCAB,
    )


class FourModuleArch:
    """Three encoders (audio and motion read token rows, image reads patches) and a decoder."""

    capabilities = Capabilities(packing=False, video=False, tp_sharded={})

    def validate(self, model: DictConfig, issues) -> None:  # nothing raw to check: all declared here
        return None

    def architecture(self, model: DictConfig) -> Architecture:
        mods = {
            "audio": _encoder(edge="audio_embeds", pixels=False, layers=3),
            "image": _encoder(edge="image_embeds", pixels=True),
            "motion": _encoder(edge="motion_embeds", pixels=False, hidden=8, layers=1),
            "decoder": _decoder(),
        }
        return Architecture(modules=mods, capabilities=self.capabilities)

    def module_axes(self, name: str, model: DictConfig) -> ModuleAxes:
        heads = self.architecture(model).modules[name].blocks[0].attention.heads
        return ModuleAxes(tp=True, sp=False, tp_sequence_parallel=False, tp_divides={"heads": heads})


@pytest.fixture(scope="module")
def family() -> Iterator[None]:
    register_family(FAMILY, lambda: None, arch=FourModuleArch())
    yield
    unregister_family(FAMILY)


def _cfg(placement: str, gpus: dict[str, int], *, tp: int = 1) -> DictConfig:
    """The tiny recipe (4 CPU slots, synthetic data: one 64-patch image per sample) with the four
    modules: producers on dp only, the decoder at ``tp``."""
    base = load_config("tiny_vlm", [])
    cfg = OmegaConf.create(OmegaConf.to_container(base))
    enc, dec = OmegaConf.to_container(base.modules.vision), OmegaConf.to_container(base.modules.llm)
    mods = {}
    for name in MODULES:
        mod = OmegaConf.create(dec if name == "decoder" else enc)
        t = tp if name == "decoder" else 1
        mod.gpus, mod.parallel.dp, mod.parallel.sp, mod.parallel.tp = gpus[name], gpus[name] // t, 1, t
        mod.parallel.sequence_parallel = False
        mod.seq_len = {"audio": 96, "motion": 16}.get(name, 256)  # audio/motion: per sample
        mods[name] = mod
    cfg.modules = mods
    cfg.model.family, cfg.placement = FAMILY, placement
    OmegaConf.set_readonly(cfg, True)
    return cfg


MIXED = "audio+image/motion/decoder"  # audio and image share a GPU; motion and decoder have their own
MIXED_GPUS = {"audio": 1, "image": 1, "motion": 1, "decoder": 2}


def test_the_graph_and_phases_come_from_the_declaration(family) -> None:
    cfg = _cfg(MIXED, MIXED_GPUS, tp=2)
    assert run_graph(cfg) == ModuleGraph("decoder", PRODUCERS)
    plan = compile_plan(cfg)
    phases = (
        "audio_fwd", "image_fwd", "motion_fwd", "handoff", "decoder_fwd", "decoder_bwd", "handback",
        "motion_bwd", "image_bwd", "audio_bwd", "grad_sync", "grad_norm", "optimizer",
    )  # fmt: skip
    for group in plan.groups:
        assert tuple(group.ranks[0].memory.phases) == phases, group.name


def test_a_mixed_partition_gets_its_gpus_fractions_and_bundles(family) -> None:
    plan = compile_plan(_cfg(MIXED, MIXED_GPUS, tp=2))
    gpus = {g.name: [r.global_gpu for r in g.ranks] for g in plan.groups}
    assert gpus == {"audio": [0], "image": [0], "motion": [1], "decoder": [2, 3]}
    fractions = {g.name: {r.gpu_fraction for r in g.ranks} for g in plan.groups}
    assert fractions == {"audio": {0.5}, "image": {0.5}, "motion": {1.0}, "decoder": {1.0}}
    (pg,) = plan.placement_groups  # one node: one placement group, a bundle per GPU
    cpus = plan_cpus = [b["CPU"] for b in pg.bundles]
    assert cpus == [0.5, 0.25, 0.25, 0.25] and plan_cpus == cpus  # cpus_per_rank 0.25 x sharers
    assert [d.groups for d in plan.devices] == [("audio", "image"), ("motion",), ("decoder",), ("decoder",)]
    # the sets take GPUs in the order written
    other = compile_plan(_cfg("decoder/audio+image/motion", MIXED_GPUS, tp=2))
    assert {g.name: [r.global_gpu for r in g.ranks] for g in other.groups} == {
        "audio": [2], "image": [2], "motion": [3], "decoder": [0, 1],
    }  # fmt: skip


def test_each_module_is_sized_from_its_own_declaration_and_a_gpu_sums_its_sharers(family) -> None:
    cfg = _cfg(MIXED, MIXED_GPUS, tp=2)
    plan = compile_plan(cfg)
    arch = FourModuleArch().architecture(cfg.model)
    mem = {g.name: g.ranks[0].memory for g in plan.groups}
    for name, m in mem.items():  # fp32: 4 bytes per parameter, TP shards the decoder's
        p = arch.modules[name].params
        tp = 2 if name == "decoder" else 1
        assert m.params == int(4 * (p.tp_sharded / tp + p.replicated)), name
        assert m.grads == m.params and m.optimizer == 2 * m.params
    assert len({m.params for m in mem.values()}) == 4  # four different declarations
    shared, motion = plan.devices[0], plan.devices[1]
    for phase, total in shared.by_phase.items():  # GPU 0 holds audio's and image's ranks
        assert total == mem["audio"].phases[phase] + mem["image"].phases[phase]
    assert motion.by_phase == mem["motion"].phases
    assert shared.reserve > motion.reserve  # a reserve per process on the GPU


def _times(fwd: float, bwd: float, fin: float) -> dict[str, float]:
    return {"fwd_s": fwd, "bwd_s": bwd, "grad_sync_s": fin / 2, "optim_s": fin / 2}


PER = {
    "audio": _times(1.0, 2.0, 0.5),  # 3 s a micro-batch
    "image": _times(4.0, 6.0, 1.0),  # 10 s
    "motion": _times(2.0, 2.0, 0.25),  # 4 s
    "decoder": _times(3.0, 3.0, 0.5),  # 6 s + 2 x 0.5 s hand-off = 7 s
}
GRAPH = ModuleGraph("decoder", PRODUCERS)


def test_sharing_sets_run_serially_and_disjoint_sets_side_by_side() -> None:
    def step(placement: str) -> float:
        return schedule(placement, PER, graph=GRAPH, n_mb=4, handoff=0.5).step_s

    serial = 4 * (3 + 10 + 4 + 7) + (0.5 + 1.0 + 0.25 + 0.5)
    assert step("collocated") == pytest.approx(serial)
    # audio+image share their GPUs: 13 s a micro-batch, the slowest producers' set; it hides the
    # decoder (7 s) and motion (4 s), which run at the same time on GPUs of their own
    mixed = schedule(MIXED, PER, graph=GRAPH, n_mb=4, handoff=0.5)
    assert mixed.step_s == pytest.approx(4 * 13 + 7 + 1.5)  # the longest finish: audio's + image's
    assert mixed.bottleneck == "image" and mixed.step_s < serial
    # a set idles while the pipeline fills and drains: the decoder's last micro-batch here
    assert mixed.idle_s["audio"] == mixed.idle_s["image"] == pytest.approx(mixed.step_s - (4 * 13 + 1.5))
    assert mixed.idle_s["motion"] == pytest.approx(mixed.step_s - (4 * 4 + 0.25))
    # every module apart: the slowest producer (image, 10 s) alone bounds a micro-batch
    assert step("disaggregated") == pytest.approx(4 * 10 + 7 + 1.0)
    # a producer on the decoder's GPUs runs in turn with it: 7 + 4 = 11 s, the bottleneck now
    with_motion = schedule("audio/image/motion+decoder", PER, graph=GRAPH, n_mb=4, handoff=0.5)
    assert with_motion.step_s == pytest.approx(4 * 11 + 10 + 1.0)  # image's finish is the longest
    assert with_motion.bottleneck == "decoder"


def test_the_estimate_overlaps_disjoint_sets(family) -> None:
    mixed = compile_plan(_cfg(MIXED, MIXED_GPUS, tp=2)).estimate
    serial = compile_plan(_cfg("collocated", dict.fromkeys(MODULES, 2), tp=2)).estimate
    for est, overlap in ((mixed, True), (serial, False)):
        n, mods = est["micro_batches"], est["modules"]
        work = sum(m["fwd_s"] + m["bwd_s"] for m in mods.values()) + 2 * n * est["handoff_s"]
        finish = sum(m["grad_sync_s"] + m["optim_s"] for m in mods.values())
        if overlap:  # the producers' sets work while the decoder runs
            assert est["step_time_s"] < work + finish
        else:  # one set: every phase in turn (plus the driver's dispatch per micro-batch)
            cfg = _cfg("collocated", dict.fromkeys(MODULES, 2), tp=2)
            dispatch = n * cfg.cluster.dispatch_overhead_s
            assert est["step_time_s"] == pytest.approx(work + finish + dispatch, rel=1e-9)
            assert est["bottleneck"] == "serial (shared GPUs)"


def test_placement_is_validated_with_the_key_and_the_fix() -> None:
    mods = list(MODULES)
    assert parse_placement("audio+image/motion/decoder", mods)[1] is None
    cases = {
        "audio+image,motion/decoder": "separated by '/', not ','",
        "audio+sonar/motion/decoder": "names 'sonar', which is not a module",
        "audio+image/image/motion/decoder": "puts module 'image' in two sets",
        "audio+image/decoder": "leaves out module(s) ['motion']",
        "colocated": "must be collocated, disaggregated or a partition",
    }
    for value, why in cases.items():
        problem = parse_placement(value, mods)[1]
        assert problem is not None and why in problem and "Fix:" in problem, value
        with pytest.raises(PlanError, match=re.escape(f"placement={value}: ")):
            sharing_sets(value, mods)
    gpus = dict(MIXED_GPUS)
    ok = placement_problems(gpus, {}, placement=MIXED, handoff="auto", device="cpu", total_gpus=4)
    assert ok == []
    bad = placement_problems(
        {**gpus, "image": 2}, {}, placement=MIXED, handoff="auto", device="cpu", total_gpus=4
    )
    assert [(i.path, "sharing set audio+image" in i.rule) for i in bad] == [
        ("placement", True),
        ("cluster", False),
    ]
    # on cuda one producer on the decoder's GPUs (cuda_ipc) and one apart (p2p) cannot share a transport
    (mixed,) = placement_problems(
        {**gpus, "decoder": 1}, {}, placement="audio+image/motion+decoder", handoff="auto", device="cuda",
        total_gpus=4, consumer="decoder",
    )  # fmt: skip
    assert mixed.path == "handoff" and "different transports" in mixed.rule
    assert len(partitions(mods)) == 15  # the Bell number of 4


def test_auto_searches_all_four_modules(family) -> None:
    cfg = _cfg(MIXED, MIXED_GPUS, tp=2)
    # the producers' AC and the micro-batch fixed, to keep the test short; every module's degrees and
    # GPUs, the decoder's AC and the placement are searched
    fixed = {"train.micro_batch_size", *(f"modules.{p}.activation_checkpointing" for p in PRODUCERS)}
    search = Search(cfg, fixed)
    classes = search.classes()
    # four modules: collocated, the producers together apart from the decoder, disaggregated (on 4, 2
    # and 1 GPUs, every split over the sets), and the run config's own mixed partition
    assert {c.placement for c in classes} == {
        "collocated",
        "audio+image+motion/decoder",
        "disaggregated",
        MIXED,
    }
    assert ("audio+image+motion/decoder", 3, 3, 3, 1) in search.placements()
    assert (MIXED, 1, 1, 1, 2) in search.placements() and ("disaggregated", 1, 1, 1, 1) in search.placements()
    found = search.run()
    assert found and all(tuple(m.name for m in c.choices) == MODULES for c in found)
    assert {c.placement for c in found} >= {"disaggregated", "audio+image+motion/decoder", MIXED}
    assert "collocated on 4 GPUs" in search.ruled_out  # visited; slower than the 10th best (bound)
    own = search.own()
    assert own is not None and own.label() in {c.label() for c in found}
    plan = compile_plan(cfg)
    assert own.step_s == pytest.approx(plan.estimate["step_time_s"], rel=1e-9)
    assert own.peak == max(d.total for d in plan.devices)
    best = found[0]
    assert best.step_s <= own.step_s
    ov = best.overrides()
    assert all(any(o.startswith(f"modules.{m}.gpus=") for o in ov) for m in MODULES)
    # every producer's GPUs, degrees and AC come from its own axes: the decoder's tp divides its 4 heads
    assert {c.decoder.degrees.tp for c in found} <= {1, 2, 4}
    assert any(c.audio.degrees.tp > 1 or c.image.degrees.dp > 1 for c in found)
    peak = max(gpu_timeline([m.terms]).peak for m in best.choices)
    assert best.peak >= peak  # a shared GPU holds at least its fullest module
