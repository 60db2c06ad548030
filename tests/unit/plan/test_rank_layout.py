"""dhp.layout.ParallelLayout against the rank formula r = ((((pp*D + dp)*F + fsdp)*C + cp)*S + sp)*T + tp, the folds
derived from it (token-parallel ranks, experts' grid, ZeRO-1 shards), each living in that one module only;
and the config's degrees read by its builder only. Pure and fast."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import dhp
from dhp.config.constants import PARALLEL_AXES
from dhp.layout import ParallelLayout, stage_cut
from dhp.runtime.actors import dispatch

MESHES = [
    {"dp": 1},
    {"dp": 4},
    {"fsdp": 3},
    {"dp": 2, "tp": 2},
    {"dp": 2, "sp": 2, "tp": 2},
    {"dp": 2, "fsdp": 3, "sp": 2, "tp": 4},
    {"fsdp": 2, "tp": 4},
    {"dp": 3, "sp": 4},
    {"cp": 2, "tp": 2},
    {"dp": 2, "fsdp": 2, "cp": 2, "tp": 2},
    {"pp": 2, "tp": 2},
    {"pp": 3, "dp": 2, "cp": 2},
]


def _formula(d: dict[str, int], c: dict[str, int]) -> int:
    dp = c["pp"] * d["dp"] + c["dp"]
    return (((dp * d["fsdp"] + c["fsdp"]) * d["cp"] + c["cp"]) * d["sp"] + c["sp"]) * d["tp"] + c["tp"]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()))
def test_layout_matches_the_formula(mesh):
    lay = ParallelLayout.from_config(mesh)
    d = {a: mesh.get(a, 1) for a in PARALLEL_AXES}
    assert lay.degrees == d and list(lay.degrees) == list(PARALLEL_AXES)
    stage = d["dp"] * d["fsdp"] * d["cp"] * d["sp"] * d["tp"]
    world = d["pp"] * stage
    assert lay.stage_world == stage
    assert lay.world_size == world
    assert lay.mesh() == ({a: v for a, v in d.items() if v > 1} or {"dp": 1})
    assert ParallelLayout.from_config(lay.mesh()) == lay
    assert ParallelLayout.from_config(OmegaConf.create(dict(d, zero=0))) == lay
    assert ParallelLayout.from_config(lay.config_values()) == lay
    assert lay.num_replicas == d["dp"] * d["fsdp"]
    assert lay.ranks_per_replica == d["cp"] * d["sp"] * d["tp"]
    assert lay.num_units == d["dp"] * d["fsdp"] * d["cp"] * d["sp"]
    seen = set()
    for cpp, cdp, cf, cc, cs, ct in itertools.product(*(range(d[a]) for a in PARALLEL_AXES)):
        c = {"pp": cpp, "dp": cdp, "fsdp": cf, "cp": cc, "sp": cs, "tp": ct}
        r = _formula(d, c)
        seen.add(r)
        assert lay.coords(r) == c
        assert lay.rank_of(c) == r
        assert lay.pp_rank(r) == cpp and lay.is_first_stage(r) == (cpp == 0)
        # every stage's facts are the first stage's, mirrored: units and leaders are first-stage ranks
        first = r - cpp * stage
        assert lay.pipeline_peers(r) == [first + s * stage for s in range(d["pp"])]
        assert lay.replica_of(r) == cdp * d["fsdp"] + cf
        assert lay.unit_of(r) == ((cdp * d["fsdp"] + cf) * d["cp"] + cc) * d["sp"] + cs
        assert lay.unit_leader(lay.unit_of(r)) == first - ct
        assert first in lay.replica_ranks(lay.replica_of(r)) and first in lay.unit_ranks(lay.unit_of(r))
        assert lay.is_replica_leader(r) == (cpp == 0 and cc == 0 and cs == 0 and ct == 0)
    assert seen == set(range(world))
    assert lay.leaders() == [
        r
        for r in range(world)
        if lay.coords(r)["pp"] == lay.coords(r)["cp"] == lay.coords(r)["sp"] == lay.coords(r)["tp"] == 0
    ]
    for axis in PARALLEL_AXES:
        groups = lay.axis_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(world))
        for g in groups:
            assert [lay.coords(r)[axis] for r in g] == list(range(d[axis]))
            others = {tuple(v for a, v in lay.coords(r).items() if a != axis) for r in g}
            assert len(others) == 1
            assert g[-1] - g[0] < lay.span(axis)
    assert lay.span("pp") == world and lay.span("dp") == stage and lay.span("tp") == d["tp"]


def test_bad_input_is_an_error():
    lay = ParallelLayout.from_config({"dp": 2, "tp": 2})
    with pytest.raises(ValueError, match="outside world size"):
        lay.coords(4)
    with pytest.raises(ValueError, match="outside degree"):
        lay.rank_of({"tp": 2})
    with pytest.raises(ValueError, match="not among"):
        ParallelLayout.from_config({"vp": 2})


def test_dispatch_re_exports_the_one_layout():
    assert dispatch.ParallelLayout is ParallelLayout


@pytest.mark.parametrize(
    ("degrees", "grid"),
    [
        # dp=2 x sp=2 x tp=2, ep=2: EP groups are SP neighbours within one tp index, [tp][edp][ep]
        ({"dp": 2, "sp": 2, "tp": 2, "ep": 2}, [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]),
        ({"dp": 2, "sp": 2, "tp": 2, "ep": 4}, [[[0, 2, 4, 6]], [[1, 3, 5, 7]]]),
        ({"fsdp": 2, "dp": 2, "ep": 2}, [[[0, 1], [2, 3]]]),
        ({"dp": 4}, [[[0], [1], [2], [3]]]),
    ],
)
def test_the_expert_fold(degrees, grid):
    lay = ParallelLayout.from_config(degrees)
    assert lay.expert_grid() == grid
    assert lay.token_ranks == lay.dp * lay.fsdp * lay.sp == lay.ep * lay.edp
    assert len(grid) == lay.tp and all(len(g) == lay.edp and len(g[0]) == lay.ep for g in grid)
    assert sorted(r for g in grid for e in g for r in e) == list(range(lay.world_size))
    for g in grid:  # an EP group holds ranks of one TP index, each seeing different tokens
        for group in g:
            assert len({lay.coords(r)["tp"] for r in group}) == 1
            assert len({lay.replica_of(r) * lay.sp + lay.coords(r)["sp"] for r in group}) == len(group)
    assert lay.ep_span == lay.ep * lay.tp


def test_the_expert_fold_with_expert_tp_and_expert_fsdp():
    # etp = tp: one all-to-all group takes every TP rank of its ep units (ep x tp consecutive ranks)
    lay = ParallelLayout(dp=2, sp=2, tp=2, ep=2, etp=2)
    assert lay.expert_grid() == [[[0, 1, 2, 3], [4, 5, 6, 7]]]
    assert lay.expert_group == 4 and len(lay.expert_grid()) == 1 and lay.expert_param_shards == 4
    assert len(ParallelLayout(dp=2, tp=2, ep=2).expert_grid()) == 2  # etp = 1: every TP rank the same
    # expert FSDP: the experts also cut over their edp ranks, their states with them
    fsdp = ParallelLayout(fsdp=4, ep=2, expert_fsdp=True)
    assert fsdp.edp == 2 and fsdp.expert_param_shards == 4 and fsdp.expert_optimizer_shards == 2
    assert fsdp.replace(expert_fsdp=False).expert_param_shards == 2
    both = ParallelLayout(fsdp=2, tp=2, etp=2, expert_fsdp=True)
    assert both.expert_grid() == [[[0, 1], [2, 3]]] and both.expert_param_shards == 4
    assert ParallelLayout.from_config({"tp": 2, "etp": 2, "expert_fsdp": 1}).expert_fsdp is True


def test_zero1_and_sequence_shards():
    lay = ParallelLayout(dp=2, sp=2, ep=2, zero=1)
    assert lay.zero1_ranks == 4 and lay.optimizer_shards == 4 and lay.expert_optimizer_shards == 2
    plain = lay.replace(zero=0)
    assert plain.optimizer_shards == 1 and plain.expert_optimizer_shards == 1
    assert ParallelLayout(tp=4, sequence_parallel=True).seq_split == 4
    assert ParallelLayout(tp=1, sequence_parallel=True).seq_split == 1
    assert ParallelLayout(tp=4).seq_split == 1
    assert ParallelLayout(dp=2, tp=2).inner_axis(("sp", "tp")) == "tp"
    assert ParallelLayout(dp=2).inner_axis(("sp", "tp")) is None
    with pytest.raises(ValueError, match="both > 1"):
        ParallelLayout(sp=2, tp=2).inner_axis(("sp", "tp"))


def _reads_of_the_config_degrees(tree: ast.AST) -> list[int]:
    """Lines of ``tree`` that read a config node's ``parallel`` (``x.parallel``, ``x["parallel"]``,
    ``getattr(x, "parallel")``), other than the ``dhp.parallel`` package itself."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "parallel":
            if not (isinstance(node.value, ast.Name) and node.value.id == "dhp"):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            if node.slice.value == "parallel":
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr", "hasattr"):  # noqa: SIM102
            if any(isinstance(a, ast.Constant) and a.value == "parallel" for a in node.args[1:2]):
                lines.append(node.lineno)
    return sorted(lines)


def test_only_the_layout_builder_reads_the_degrees_of_the_config():
    """Every degree has one value: ``dhp.layout.module_layout`` reads ``modules.<m>.parallel`` (and
    ``write_layout`` rewrites it); everything else asks the layout that the plan carries."""
    root = Path(dhp.__file__).parent
    hits = []
    for path in sorted(root.rglob("*.py")):
        lines = _reads_of_the_config_degrees(ast.parse(path.read_text()))
        if path == root / "layout.py":
            assert len(lines) == 2, lines  # module_layout and write_layout
            continue
        hits += [f"{path.relative_to(root.parent)}:{n}" for n in lines]
    assert not hits, "a config degree read outside dhp.layout.module_layout:\n" + "\n".join(hits)


def test_the_degree_reader_sees_every_spelling():
    """The scan above is not blind: each spelling of a read is found (and ``dhp.parallel`` is not one)."""
    code = 'a = m.parallel.tp\nb = m["parallel"]\nc = getattr(m, "parallel")\nimport dhp\nd = dhp.parallel\n'
    assert _reads_of_the_config_degrees(ast.parse(code)) == [1, 2, 3]


# Spellings of the rank layout that used to be computed outside dhp/layout.py: the rank formula, the
# replica / world products over parallel degrees, and rank // or % arithmetic on replica or TP sizes.
_OTHER_SPELLINGS = [
    r"\*\s*S\s*\+\s*sp",  # the formula itself
    r"\(\s*dp\s*\*\s*F\b",
    r"\.dp\s*\*\s*[\w.\[\]\"']*\.fsdp\b",  # replicas = par.dp * par.fsdp
    r"\.fsdp\s*\*\s*[\w.]*\.sp\s*\*",  # world / span products
    r"\.sp\s*\*\s*[\w.]*\.tp\b",
    r"degrees\[\"(dp|sp)\"\]\s*\*",
    r"get\(\"(sp|tp)\",\s*1\)\s*\*",
    r"\brank\s*(//|%)",
    r"reversed\((PARALLEL_)?AXES\)",  # coords by peeling axes inner -> outer
    r"\bdef\s+(replica_of|unit_of|unit_leader|rank_of)\b",
]


def test_the_rank_layout_is_computed_in_one_place_only():
    root = Path(dhp.__file__).parent
    hits = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "layout.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if any(re.search(p, code) for p in _OTHER_SPELLINGS):
                hits.append(f"{path.relative_to(root.parent)}:{n}: {line.strip()}")
    assert not hits, (
        "rank layout computed outside dhp/layout.py (use dhp.layout.ParallelLayout):\n" + "\n".join(hits)
    )
    text = (root / "layout.py").read_text()
    assert all(re.search(p, text) for p in (_OTHER_SPELLINGS[0], r"\bdef\s+rank_of\b"))


def test_pipeline_stages_and_their_cut():
    lay = ParallelLayout(pp=2, pp_virtual=2, dp=2, ep=2, pp_schedule="interleaved_1f1b")
    assert lay.num_stages == 4 and lay.stage_world == 2
    assert [lay.stages_of(r) for r in range(4)] == [[0, 2], [0, 2], [1, 3], [1, 3]]
    assert [lay.holds_last_stage(r) for r in range(4)] == [False, False, True, True]
    # each stage's experts' grid is the first stage's, offset by the stage's ranks
    assert lay.stage_expert_grids() == [[[[0, 1]]], [[[2, 3]]]]
    assert ParallelLayout.from_config(lay.config_values()) == lay
    # the cut: contiguous, every layer once, the extra layers to the middle stages, then the first
    assert stage_cut(4, 2) == [(0, 2), (2, 4)]
    assert stage_cut(5, 2) == [(0, 3), (3, 5)]
    assert stage_cut(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    for layers in range(1, 13):
        for stages in range(1, layers + 1):
            cut = stage_cut(layers, stages)
            assert cut[0][0] == 0 and cut[-1][1] == layers
            assert all(a[1] == b[0] for a, b in itertools.pairwise(cut))
            sizes = [hi - lo for lo, hi in cut]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4"):
        stage_cut(3, 4)
