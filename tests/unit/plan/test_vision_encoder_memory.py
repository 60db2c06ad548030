"""What the Qwen3 vision encoder (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5) saves for backward is what the
planner counts from its declared architecture: an ungated MLP (2 MLP widths per token and block, not
a SwiGLU's 4) and one side merger per DeepStack level (norm, matmul and activation outputs: 3 merged
rows per ``merge`` patches).

The family's own vision module (transformers' ``Qwen3VLVisionModel`` in dhp's wrapper, what a rank
runs) does one forward under a saved-tensors hook that collects the storages autograd keeps
(parameters excluded, each storage once, as ``dhp.metrics.accounting`` counts them), at sizes that
move each term: the MLP width, the DeepStack levels, depth and hidden.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from dhp.config.schema import ModuleConfig
from dhp.layout import module_layout
from dhp.models.entries import model_entry
from dhp.models.registry import get_family
from dhp.plan.memory import activations_of, module_shape

pytestmark = pytest.mark.unit

PATCHES = 256  # one 16x16-patch image


def _saved_bytes(module: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> int:
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(pixels, grid)
    return sum(saved.values())


@pytest.mark.parametrize(
    ("hidden", "mlp", "depth", "deepstack"),
    [(32, 64, 3, [0, 1]), (32, 256, 3, []), (64, 64, 4, [1, 2, 3]), (64, 128, 2, [0])],
)
def test_encoder_saved_bytes_match_the_plan(hidden: int, mlp: int, depth: int, deepstack: list[int]) -> None:
    model = OmegaConf.merge(
        OmegaConf.structured(model_entry("tiny_qwen3_vl")),
        {
            "vision": {
                "hidden_size": hidden,
                "intermediate_size": mlp,
                "depth": depth,
                "extra": {"deepstack_visual_indexes": deepstack},
            },
            "llm": {"num_layers": 4},
        },
    )
    family = get_family("qwen3_vl")
    hf = family.hf_config(model)
    torch.manual_seed(0)
    vision = family.build_module("vision", hf, device="cpu", dtype=torch.float32)
    row = model.vision.in_channels * model.vision.temporal_patch_size * model.vision.patch_size**2
    side = int(PATCHES**0.5)
    measured = _saved_bytes(vision, torch.randn(PATCHES, row), torch.tensor([[1, side, side]]))

    module = OmegaConf.merge(
        OmegaConf.structured(ModuleConfig),
        {"parallel": {"dp": 1, "fsdp": 1, "sp": 1, "tp": 1}, "seq_len": PATCHES, "mixed_precision": "fp32"},
    )
    shape = module_shape(
        "vision",
        model=model,
        module=module,
        layout=module_layout(module),
        micro_batch=1,
        image_patches=PATCHES,
    )
    predicted = sum(activations_of(shape).values())
    # within 2 %: these settings agree within 0.5 % (what is left: norm statistics, rotary tables and
    # the position-table taps); a SwiGLU's 4 MLP widths or a missed DeepStack merger is 6-25 % here
    assert measured == pytest.approx(predicted, rel=0.02)
