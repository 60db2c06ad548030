"""`--auto`'s search space holds selective AC and the LLM's sequence parallelism, keeps what the user
fixed, and its overrides round-trip through `apply` as typed values."""

from __future__ import annotations

import pytest

from dhp.plan.search import Search, apply
from dhp.validation import load_config

pytestmark = pytest.mark.unit


def test_search_space_has_selective_ac_and_llm_sequence_parallel() -> None:
    cfg = load_config("tiny_vlm", [])
    search = Search(cfg, set())
    llm = search._degrees("llm", 4)
    assert {d.sequence_parallel for d in llm if d.tp > 1} == {False, True}
    assert not any(d.sequence_parallel for d in llm if d.tp == 1)  # SP-in-TP needs a TP group
    assert not any(d.sequence_parallel for d in search._degrees("vision", 4))
    assert search._acs("llm") == search._acs("vision") == ["off", "selective", "full"]
    with_sp = next(d for d in llm if d.tp == 2 and d.sequence_parallel)
    without = next(d for d in llm if d.tp == 2 and not d.sequence_parallel and d.zero == with_sp.zero)
    assert search._keep("llm", 4, with_sp, "off") and search._keep("llm", 4, without, "off")
    # the recipe sets sequence_parallel: true; fixed on the command line, the plain TP one is dropped
    fixed = Search(cfg, {"modules.llm.parallel.sequence_parallel"})
    assert fixed._keep("llm", 4, with_sp, "off") and not fixed._keep("llm", 4, without, "off")
    # the terms differ: SP-in-TP cuts the LLM's norm/residual activations by tp
    a = search.module("llm", 4, with_sp, "off", 2, 1, 64, 0.0).terms.saved_total
    b = search.module("llm", 4, without, "off", 2, 1, 64, 0.0).terms.saved_total
    assert a < b


def test_overrides_apply_as_typed_values() -> None:
    cfg = load_config("tiny_vlm", [])
    (best,) = Search(cfg, set()).run(keep=1)
    out = apply(cfg, best.overrides())
    assert out.modules.llm.parallel.sequence_parallel is best.llm.degrees.sequence_parallel
    assert out.modules.llm.activation_checkpointing == best.llm.ac


def test_search_may_use_fewer_gpus_than_the_cluster() -> None:
    cfg = load_config("tiny_vlm", [])  # local_cpu: 4 CPU slots
    search = Search(cfg, set())
    assert search.totals() == [4, 2, 1]
    places = search.placements()
    assert ("collocated", 4, 4) in places and ("disaggregated", 1, 3) in places
    assert ("collocated", 2, 2) in places and ("disaggregated", 1, 1) in places
    assert ("collocated", 1, 1) in places and not any(v + lw > 4 for p, v, lw in places if p != "collocated")
    fixed = Search(cfg, {"placement"})  # the recipe is collocated: no disaggregated split is tried
    assert {p for p, _, _ in fixed.placements()} == {"collocated"}


def test_oversubscription_counts_every_rank_process_and_the_driver() -> None:
    from dhp.plan.estimate import DRIVER_PROCESSES, busy_processes, oversubscription

    assert DRIVER_PROCESSES == 1.0 and busy_processes(4) == 5.0  # vision and llm 2 ranks each
    cfg = load_config("tiny_vlm", [])  # host_cores: 2
    assert oversubscription(cfg.cluster, 5.0) == 2.5 and oversubscription(cfg.cluster, 1.0) == 1.0
    gpu = load_config("qwen_vl_7b", [])  # host_cores 0: GPUs never share
    assert oversubscription(gpu.cluster, 9.0) == 1.0
