"""What an expert-parallel MoE block saves for backward, per AC mode, is what the planner counts
(``dhp.plan.blocks.moe_saved_elems``), and the load-balancing loss's router probabilities outlive AC.

The family's own LLM module (tiny Qwen3-VL-MoE: routed experts only; tiny Qwen3.5-MoE: routed plus a
gated shared expert) has its experts swapped for ``dhp.parallel.ep.ExpertParallelExperts`` over an EP
group of one gloo rank (the dispatch and combine all-to-alls run, and every rank receives exactly the
rows it sends: r = 1, the planner's balanced router), then AC is applied as the runtime applies it.
One forward runs under ``dhp.metrics.accounting.saved_by_part``: the storages autograd saves and
selective checkpointing caches while each MoE block runs, each once, parameters excluded. The
2-rank measurement (uneven routing) is ``scripts/bench_planner.py --blocks``.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from dhp.layout import ParallelLayout
from dhp.metrics.accounting import saved_by_part
from dhp.models.entries import model_entry
from dhp.models.registry import get_arch, get_family
from dhp.parallel import AcSpec, apply_ac, build_mesh
from dhp.parallel.ep import apply_ep, ep_mesh
from dhp.plan.blocks import mlp_saved_elems, router_aux_bytes

pytestmark = pytest.mark.unit

TOKENS = 128
TOLERANCE = 0.05  # the formula counts every storage; what is left is float rounding of r and sizes
CASES = {"tiny_qwen3_vl_moe": "qwen3_vl_moe", "tiny_qwen3_5_moe": "qwen3_5"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/store", rank=0, world_size=1
    )
    try:
        yield build_mesh(ParallelLayout(), "cpu")
    finally:
        dist.destroy_process_group()


@functools.cache
def _arch(model: str):
    return get_arch(CASES[model]).architecture(OmegaConf.structured(model_entry(model))).modules["llm"]


def _measure(mesh, model: str, ac: str) -> tuple[list[int], int]:
    """(saved bytes of each MoE block, saved bytes outside every block) of one forward."""
    family = get_family(CASES[model])
    torch.manual_seed(0)
    module = family.build_module(
        "llm", family.hf_config(model_entry(model)), device="cpu", dtype=torch.float32
    )
    apply_ep(module, ep_mesh(mesh, ParallelLayout()), block_glob=module.parallel_plan.moe_blocks)
    if ac != "off":
        apply_ac(module, None, AcSpec(kind=ac))
    layers = module.language_model.layers
    parts = {f"moe{i}": layer.mlp for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")}
    parts.update({f"layer{i}": layer for i, layer in enumerate(layers)})
    ids = torch.randint(20, 1000, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    saved, _ = saved_by_part(
        lambda: module(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            labels=ids.clone(),
            mm_token_type_ids=torch.zeros_like(ids),
        ),
        parts,
        exclude=list(module.parameters()),
    )
    moe = [saved.get(name, 0) for name in parts if name.startswith("moe")]
    return moe, saved.get("", 0)


@pytest.mark.parametrize("model", sorted(CASES))
@pytest.mark.parametrize("ac", ["off", "selective", "full"])
def test_moe_block_saved_bytes_match_the_plan(world, model: str, ac: str) -> None:
    arch = _arch(model)
    moe, _ = _measure(world, model, ac)
    mlp = next(b.mlp for b in arch.blocks if b.mlp.kind == "moe")
    if ac == "full":  # the whole block is recomputed: it keeps nothing of its own
        assert moe == [0] * len(moe)
        return
    per_token = mlp_saved_elems(mlp, hidden=arch.hidden, tp=1, selective=ac == "selective", act=4)
    # AC off: the block's input (the norm's output) is saved by its first projection here; the
    # planner counts it with the block's norms (``dhp/plan/memory.py``: 4h per block)
    per_token += arch.hidden if ac == "off" else 0
    for measured in moe:
        assert measured == pytest.approx(TOKENS * per_token * 4, rel=TOLERANCE)


@pytest.mark.parametrize("ac", ["off", "selective", "full"])
def test_the_load_balancing_loss_keeps_its_router_probabilities_in_every_ac_mode(
    world, ac: str, monkeypatch
) -> None:
    """What the step saves outside the blocks, with and without the load-balancing loss (its module
    method replaced by a constant): the difference is the loss's fp32 probabilities and int64 top-k
    indices of every MoE block, whatever AC does to the blocks."""
    model = "tiny_qwen3_vl_moe"
    _, outside = _measure(world, model, ac)
    llm = type(get_family(CASES[model]).build_module(
        "llm", get_family(CASES[model]).hf_config(model_entry(model)), device="meta", dtype=torch.float32
    ))  # fmt: skip
    monkeypatch.setattr(llm, "router_loss", lambda self, logits, **_: (torch.zeros(()), torch.zeros(())))
    _, without = _measure(world, model, ac)
    assert outside - without == pytest.approx(TOKENS * router_aux_bytes(_arch(model).blocks), rel=0.02)
