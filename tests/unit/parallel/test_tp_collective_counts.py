"""The planner's TP collective counts are the ones torch issues: a decoder under ``decoder_tp_plan`` on a
2-rank fake process group (collectives are no-ops, every call is still dispatched), its
``_c10d_functional`` ops counted by a dispatch mode; and each family's ``tp_input_grads`` equals the
column-parallel projections of its block plan."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from dhp.models import get_family
from dhp.models.registry import get_arch
from dhp.parallel.llm_tp import decoder_tp_plan

pytestmark = pytest.mark.unit

LAYERS = 2


class _Collectives(TorchDispatchMode):
    """Counts the functional collectives dispatched inside the block (not their waits)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and not name.startswith(("wait", "_wrap")):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_decoder_tp_collectives_per_block(mesh, sequence_parallel: bool) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    parallelize_module(
        model, mesh, decoder_tp_plan(model="model", lm_head="lm_head", sequence_parallel=sequence_parallel)
    )
    embeds = torch.randn(1, 16, 32, requires_grad=True)
    with _Collectives() as fwd:
        hidden = model.model(inputs_embeds=embeds).last_hidden_state
    local = hidden.to_local() if hasattr(hidden, "to_local") else hidden
    with _Collectives() as bwd:
        local.float().pow(2).mean().backward()
    tiny = OmegaConf.structured(get_family("qwen2_5_vl").tiny_model_config())
    grads = get_arch("qwen2_5_vl").architecture(tiny).modules["llm"].tp_input_grads
    if not sequence_parallel:
        # forward: the attention and MLP outputs' all-reduces; backward: one per column-parallel input
        assert dict(fwd.counts) == {"all_reduce": 2 * LAYERS}
        assert dict(bwd.counts) == {"all_reduce": grads * LAYERS}
    else:
        # forward: RS + AG around each; backward: the inputs' grad all-reduces, the 2 outputs' grad
        # all-gathers per block, and 1 all-gather of the embeddings' grad
        assert dict(fwd.counts) == {"reduce_scatter_tensor": 2 * LAYERS, "all_gather_into_tensor": 2 * LAYERS}
        assert dict(bwd.counts) == {"all_reduce": grads * LAYERS, "all_gather_into_tensor": 2 * LAYERS + 1}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("name", ["vision", "llm"])
def test_tp_input_grads_count_the_column_parallel_projections(family: str, name: str) -> None:
    fam = get_family(family)
    model = fam.tiny_model_config()
    plan = fam.parallel_plan(name, fam.hf_config(model))
    colwise = [
        glob
        for glob, style in plan.tp(False).items()
        if isinstance(style, ColwiseParallel) and any(glob.startswith(b + ".") for b in plan.blocks)
    ]
    typed = get_arch(family).architecture(OmegaConf.structured(model)).modules[name]
    assert len(colwise) == typed.tp_input_grads, colwise


class _AllCollectives(TorchDispatchMode):
    """Counts every collective dispatched, functional (DTensor's) or not (``dist.*``: the Gated
    DeltaNet style's all-to-alls and all-reduces), all-to-alls apart."""

    def __init__(self) -> None:
        super().__init__()
        self.reduce_like = 0
        self.all_to_all = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace in ("_c10d_functional", "c10d") and not name.startswith(("wait", "_wrap")):
            if "alltoall" in name or "all_to_all" in name:
                self.all_to_all += 1
            else:
                self.reduce_like += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_hybrid_deltanet_decoder_issues_what_the_planner_counts(mesh, sequence_parallel: bool) -> None:
    """Tiny Qwen3.5 (3 Gated DeltaNet layers, 1 full-attention layer) under the family's TP plan: per
    block what ``dhp.plan.tp_blocks.tp_block`` says (a DeltaNet mixer reduces its input's and its norm
    weight's grads, not one per projection, and moves 2 weight shards by all-to-all each pass)."""
    from omegaconf import OmegaConf

    from dhp.models.entries import model_entry
    from dhp.parallel.llm_tp import apply_tp
    from dhp.plan.tp_blocks import tp_block

    family, entry = get_family("qwen3_5"), model_entry("tiny_qwen3_5")
    torch.manual_seed(0)
    module = family.build_module("llm", family.hf_config(entry), device="cpu", dtype=torch.float32)
    apply_tp(module, mesh, sequence_parallel=sequence_parallel, module_name="llm")
    h = entry.llm.hidden_size
    embeds = torch.randn(1, 16, h, requires_grad=True)
    positions = torch.arange(16).view(1, 1, 16).expand(3, 1, 16)
    with _AllCollectives() as fwd:
        hidden = module.language_model(inputs_embeds=embeds, position_ids=positions).last_hidden_state
    local = hidden.to_local() if hasattr(hidden, "to_local") else hidden
    with _AllCollectives() as bwd:
        local.float().pow(2).mean().backward()
    arch = get_arch("qwen3_5").architecture(OmegaConf.structured(entry)).modules["llm"]
    blocks = [tp_block(b, arch, 2) for b in arch.blocks]
    assert {b.attention.kind for b in arch.blocks} == {"linear", "full"}
    sp = 2 if sequence_parallel else 1  # a reduce-scatter and an all-gather for each all-reduce
    moves = sum(len(c.relayout) for c in blocks)
    assert moves == 2 * arch.count("linear")
    assert (fwd.all_to_all, bwd.all_to_all) == (moves, moves)
    assert fwd.reduce_like == sum(c.fwd_reduces * sp for c in blocks)
    gathers = (2 * len(blocks) + 1) if sequence_parallel else 0  # the outputs' grads, and the input's
    assert bwd.reduce_like == sum(c.bwd_reduces + c.bwd_small for c in blocks) + gathers
