"""The Gated DeltaNet TP layout, pure: which rows each rank computes with, the all-to-all that moves them
there (every row exactly once), the layout read off transformers' layer, and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from dhp.errors import PlanError
from dhp.parallel.linear_attn_tp import deltanet_tp_plan, gated_deltanet_layout, head_rows, row_moves
from dhp.parallel.llm_tp import check_divides

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("parts", "world"), [((4, 4, 8), 2), ((8, 8, 24), 4), ((6, 6, 6), 3), ((16,), 4)])
def test_every_rank_gets_whole_heads_of_every_part_and_every_row_moves_once(parts, world) -> None:
    total, per = sum(parts), sum(parts) // world
    moves = row_moves(parts, world)
    received = {r: [] for r in range(world)}
    for s in range(world):
        sent = [i for r in range(world) for i in moves[s][r]]
        assert sorted(sent) == list(range(per)), f"rank {s} must send each of its rows exactly once"
        for r in range(world):
            received[r] += [s * per + i for i in moves[s][r]]
    for r in range(world):
        assert received[r] == head_rows(parts, world, r)  # arrives in head-layout order, no reordering
    # head layout of rank r: piece r of each part (q_r, k_r, v_r)
    assert head_rows((4, 4, 8), 2, 1) == [2, 3, 6, 7, 12, 13, 14, 15]
    assert sorted(i for r in range(world) for i in head_rows(parts, world, r)) == list(range(total))


def _layer() -> nn.Module:
    cfg = Qwen3_5TextConfig(
        hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
        linear_value_head_dim=4, num_hidden_layers=1, layer_types=["linear_attention"],
    )  # fmt: skip
    with torch.device("meta"):
        return Qwen3_5GatedDeltaNet(cfg, layer_idx=0)


def test_layout_of_transformers_gated_deltanet() -> None:
    layout = gated_deltanet_layout(_layer())
    assert layout.fused == {"in_proj_qkv.weight": (16, 16, 24), "conv1d.weight": (16, 16, 24)}
    assert set(layout.colwise) == {
        "in_proj_z.weight",
        "in_proj_b.weight",
        "in_proj_a.weight",
        "A_log",
        "dt_bias",
    }
    assert layout.rowwise == ("out_proj.weight",) and layout.shared == ("norm.weight",)
    params = {n for n, _ in _layer().named_parameters()}
    assert params == {*layout.fused, *layout.colwise, *layout.rowwise, *layout.shared}  # every one placed
    assert dict(layout.sizes) == {
        "num_k_heads": 2,
        "num_v_heads": 6,
        "key_dim": 16,
        "value_dim": 24,
        "conv_dim": 56,
    }
    check_divides(layout.divides, degree=2, axis="tp", module="llm")
    with pytest.raises(PlanError, match=r"linear_num_key_heads=2"):
        check_divides(layout.divides, degree=3, axis="tp", module="llm")


def test_other_layers_are_refused_with_a_fix() -> None:
    with pytest.raises(PlanError, match=r"not a Gated DeltaNet.*Fix"):
        gated_deltanet_layout(nn.Linear(4, 4))
    assert list(deltanet_tp_plan("language_model.layers.*.linear_attn")) == [
        "language_model.layers.*.linear_attn"
    ]
