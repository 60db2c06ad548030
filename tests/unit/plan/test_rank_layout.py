"""dhp.layout.RankLayout against the rank formula r = ((dp*F + fsdp)*S + sp)*T + tp, and the formula
living in that one module only. Pure and fast."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import dhp
from dhp.config.constants import PARALLEL_AXES
from dhp.layout import RankLayout
from dhp.runtime import dispatch

MESHES = [
    {"dp": 1},
    {"dp": 4},
    {"fsdp": 3},
    {"dp": 2, "tp": 2},
    {"dp": 2, "sp": 2, "tp": 2},
    {"dp": 2, "fsdp": 3, "sp": 2, "tp": 4},
    {"fsdp": 2, "tp": 4},
    {"dp": 3, "sp": 4},
]


def _formula(d: dict[str, int], c: dict[str, int]) -> int:
    return ((c["dp"] * d["fsdp"] + c["fsdp"]) * d["sp"] + c["sp"]) * d["tp"] + c["tp"]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()))
def test_layout_matches_the_formula(mesh):
    lay = RankLayout.from_mesh(mesh)
    d = {a: mesh.get(a, 1) for a in PARALLEL_AXES}
    assert lay.degrees == d and list(lay.degrees) == list(PARALLEL_AXES)
    world = d["dp"] * d["fsdp"] * d["sp"] * d["tp"]
    assert lay.world_size == world
    assert lay.mesh() == ({a: v for a, v in d.items() if v > 1} or {"dp": 1})
    assert RankLayout.from_mesh(lay.mesh()) == lay
    assert RankLayout.from_parallel(OmegaConf.create(dict(d, zero=0))) == lay
    assert lay.num_replicas == d["dp"] * d["fsdp"]
    assert lay.ranks_per_replica == d["sp"] * d["tp"]
    assert lay.num_units == d["dp"] * d["fsdp"] * d["sp"]
    seen = set()
    for cdp, cf, cs, ct in itertools.product(*(range(d[a]) for a in PARALLEL_AXES)):
        c = {"dp": cdp, "fsdp": cf, "sp": cs, "tp": ct}
        r = _formula(d, c)
        seen.add(r)
        assert lay.coords(r) == c
        assert lay.rank_of(c) == r
        assert lay.replica_of(r) == cdp * d["fsdp"] + cf
        assert lay.unit_of(r) == (cdp * d["fsdp"] + cf) * d["sp"] + cs
        assert lay.unit_leader(lay.unit_of(r)) == r - ct
        assert r in lay.replica_ranks(lay.replica_of(r)) and r in lay.unit_ranks(lay.unit_of(r))
        assert lay.is_replica_leader(r) == (cs == 0 and ct == 0)
    assert seen == set(range(world))
    assert lay.leaders() == [r for r in range(world) if lay.coords(r)["sp"] == lay.coords(r)["tp"] == 0]
    for axis in PARALLEL_AXES:
        groups = lay.axis_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(world))
        for g in groups:
            assert [lay.coords(r)[axis] for r in g] == list(range(d[axis]))
            others = {tuple(v for a, v in lay.coords(r).items() if a != axis) for r in g}
            assert len(others) == 1
            assert g[-1] - g[0] < lay.span(axis)
    assert lay.span("dp") == world and lay.span("tp") == d["tp"]


def test_bad_input_is_an_error():
    lay = RankLayout.from_mesh({"dp": 2, "tp": 2})
    with pytest.raises(ValueError, match="outside world size"):
        lay.coords(4)
    with pytest.raises(ValueError, match="outside degree"):
        lay.rank_of({"tp": 2})
    with pytest.raises(ValueError, match="not among"):
        RankLayout.from_mesh({"pp": 2})


def test_dispatch_re_exports_the_one_layout():
    assert dispatch.RankLayout is RankLayout


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
    assert not hits, "rank layout computed outside dhp/layout.py (use dhp.layout.RankLayout):\n" + "\n".join(
        hits
    )
    text = (root / "layout.py").read_text()
    assert all(re.search(p, text) for p in (_OTHER_SPELLINGS[0], r"\bdef\s+rank_of\b"))
