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
