"""What a Gated DeltaNet mixer saves for backward on CPU (transformers' torch fallback of the chunked
delta rule) is what the planner counts (``dhp.plan.blocks.fallback_delta_rule_elems``).

transformers' own ``Qwen3_5GatedDeltaNet`` runs forward under a saved-tensors hook that collects the
storages autograd keeps (parameters and the input excluded, as ``dhp.metrics.accounting`` sorts
them), at head counts and widths that move each term of the formula.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from dhp.models.arch import Attention
from dhp.plan.blocks import fallback_delta_rule_elems

pytestmark = pytest.mark.unit


def _saved_bytes(hk: int, hv: int, dk: int, dv: int, seq: int) -> int:
    cfg = Qwen3_5TextConfig(
        hidden_size=64,
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(cfg, 0)
    x = torch.randn(1, seq, 64, requires_grad=True)
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(saved.values())


@pytest.mark.parametrize(
    ("hk", "hv", "dk", "dv"), [(2, 4, 16, 16), (2, 8, 16, 16), (4, 4, 32, 16), (2, 4, 16, 32)]
)
def test_fallback_saved_bytes_match_the_formula(hk: int, hv: int, dk: int, dv: int) -> None:
    seq = 256
    att = Attention(kind="linear", heads=hv, kv_heads=hk, head_dim=dk, value_dim=dv, state=dk * dv)
    predicted = seq * fallback_delta_rule_elems(att) * 4  # fp32
    # within 2 %: the fit's residual over these settings is under 0.5 %; a missed term would be >10 %
    assert _saved_bytes(hk, hv, dk, dv, seq) == pytest.approx(predicted, rel=0.02)
