"""`--auto`'s search space holds selective AC and the LLM's sequence parallelism, keeps what the user
fixed, and its overrides round-trip through `apply` as typed values."""

from __future__ import annotations

import pytest

from dhp.config import load_config
from dhp.plan.search import Search, apply, module_degrees

pytestmark = pytest.mark.unit


def test_search_space_has_selective_ac_and_llm_sequence_parallel() -> None:
    cfg = load_config("tiny_vlm", [])
    llm = module_degrees("llm", 4, cfg.model, 4)
    assert {d.sequence_parallel for d in llm if d.tp > 1} == {False, True}
    assert not any(d.sequence_parallel for d in llm if d.tp == 1)  # SP-in-TP needs a TP group
    assert not any(d.sequence_parallel for d in module_degrees("vision", 4, cfg.model, 4))
    search = Search(cfg, set())
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
