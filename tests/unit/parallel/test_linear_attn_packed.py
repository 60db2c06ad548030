"""A packed row through one Gated DeltaNet layer (``dhp.parallel.linear_attn_packed``): what transformers'
torch fallback does with it, the per-sample split, the varlen call the GPU kernels get, and the refusal.

One tiny ``Qwen3_5GatedDeltaNet`` of transformers (fp32, CPU, ``A_log`` drawn from log U(0.01, 1) so the
state carries along the row), two rows of 100 tokens: samples of 37 + 50 tokens and padding, and of
70 + 30 tokens (one sample over two delta-rule chunks, three within one: two calls of the layer). The
reference of every sample is the layer called on that sample alone.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

from dhp.errors import PlanError
from dhp.models import get_family
from dhp.ops.linear_attn import FLA_CHUNK, FLA_CHUNK_TORCH_CONV
from dhp.ops.packed import segments
from dhp.parallel import linear_attn_packed
from dhp.parallel.linear_attn_packed import deltanet_forward, split_packed_rows, varlen_boundaries

pytestmark = pytest.mark.unit

ROWS = ([37, 50, 13], [70, 30])  # sample lengths per row; 13 trailing padding tokens in row 0
ATOL = 1e-5


def _config():
    family = get_family("qwen3_5")
    return family.hf_config(family.tiny_model_config()).text_config


@pytest.fixture(scope="module")
def layer() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = hf_qwen3_5.Qwen3_5GatedDeltaNet(_config(), 0).float()
    with torch.no_grad():
        layer.A_log.copy_(torch.rand(layer.A_log.shape).mul_(0.99).add_(0.01).log_())
    return layer


def _packed(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden (2, 100, width), sample ids (2, 100)): ``ROWS``, the last run of row 0 padding."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(len(ROWS), sum(ROWS[0]), width, generator=gen)
    mask = torch.zeros(hidden.shape[:2], dtype=torch.long)
    mask[0, :37], mask[0, 37:87] = 1, 2
    mask[1, :70], mask[1, 70:] = 1, 2
    return hidden, mask


def _alone(layer, hidden: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, int, int, torch.Tensor]]:
    """(row, start, end, the layer's output on that sample alone) of every sample."""
    return [
        (r, s, e, layer(hidden[r : r + 1, s:e]))
        for r in range(mask.shape[0])
        for s, e, k in segments(mask[r])
        if k
    ]


def test_transformers_torch_fallback_mixes_packed_samples_and_refuses_varlen(layer) -> None:
    """The fact the split exists for: on CPU, transformers' layer on a packed row carries the recurrent
    state and the conv from one sample into the next; given the varlen arguments it raises."""
    hidden, mask = _packed(layer.hidden_size)
    with torch.no_grad():
        row = layer(hidden)
        alone = _alone(layer, hidden, mask)
    r, s, e, first = alone[0]
    assert torch.allclose(row[r : r + 1, s:e], first, atol=ATOL)  # the first sample sees nothing before it
    r, s, e, second = alone[1]
    assert (row[r : r + 1, s:e] - second).abs().max() > 1e-2  # the second one sees the first
    with pytest.raises(ValueError, match="can't keep packed sequences apart"):
        layer(hidden[:1], cu_seq_lens_q=torch.tensor([0, 37, 87, 100]))


def test_deltanet_forward_runs_every_sample_alone(layer) -> None:
    """Sample ids: each sample's output is the layer's on that sample alone, padding gives zeros, and
    the gradient flows the same way; a 0/1 padding mask goes to transformers' forward unchanged."""
    hidden, mask = _packed(layer.hidden_size)
    leaf = hidden.clone().requires_grad_(True)
    out = deltanet_forward(layer, hidden_states=leaf, attention_mask=mask)
    out.pow(2).sum().backward()
    ref_leaf = hidden.clone().requires_grad_(True)
    total = 0.0
    for r, s, e, want in _alone(layer, ref_leaf, mask):
        assert torch.allclose(out[r : r + 1, s:e], want, atol=ATOL), (r, s, e)
        total = total + want.pow(2).sum()
    total.backward()
    assert torch.allclose(leaf.grad, ref_leaf.grad, atol=ATOL)
    assert not out[0, 87:].any()
    padding = (mask != 0).long()
    assert torch.equal(
        deltanet_forward(layer, hidden, attention_mask=padding), layer(hidden, attention_mask=padding)
    )


def test_split_packed_rows_makes_it_the_layer_forward(layer) -> None:
    hidden, mask = _packed(layer.hidden_size)
    plain = hf_qwen3_5.Qwen3_5GatedDeltaNet(_config(), 0).float()
    plain.load_state_dict(layer.state_dict())
    split_packed_rows(plain)
    with torch.no_grad():
        want = deltanet_forward(layer, hidden, attention_mask=mask)
        assert torch.equal(plain(hidden_states=hidden, attention_mask=mask), want)


def test_varlen_boundaries_of_the_flattened_micro_batch() -> None:
    _, mask = _packed(8)
    cu, seq_idx = varlen_boundaries(mask)
    assert cu.tolist() == [0, 37, 87, 100, 170, 200] and cu.dtype == torch.long
    assert seq_idx.shape == (1, 200) and seq_idx.dtype == torch.int32
    assert seq_idx[0].bincount().tolist() == [37, 50, 13, 70, 30]


def _conv_standin(original):
    """causal-conv1d's calling convention on CPU: ``seq_idx`` (1, L) int32 on a channel-last ``x``
    (the CUDA kernel's requirement), the conv restarted at every run (the torch conv on each run);
    ``unused``: what the kernel's signature does not take (transformers' dispatcher filters it out)."""

    def conv(x, weight, bias=None, activation=None, seq_idx=None, **unused):
        assert seq_idx is not None and seq_idx.dtype == torch.int32 and seq_idx.shape == (1, x.shape[-1])
        assert x.shape[0] == 1 and x.stride(1) == 1, "seq_idx needs one channel-last row"
        cuts = (torch.nonzero(seq_idx[0, 1:] != seq_idx[0, :-1]).flatten() + 1).tolist()
        bounds = itertools.pairwise([0, *cuts, x.shape[-1]])
        return torch.cat([original(x[..., a:b], weight, bias, activation=activation) for a, b in bounds], -1)

    return conv


def _rule_standin(original):
    """flash-linear-attention's calling convention on CPU: one row, ``cu_seqlens`` (N + 1), the state
    restarted at every sequence (the torch rule on each)."""

    def rule(query, key, value, g, beta, cu_seqlens=None, use_qk_l2norm_in_kernel=False, **unused):
        assert cu_seqlens is not None and query.shape[0] == 1, "cu_seqlens needs one flattened row"
        outs = [
            original(
                query[:, a:b],
                key[:, a:b],
                value[:, a:b],
                g=g[:, a:b],
                beta=beta[:, a:b],
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            )[0]
            for a, b in itertools.pairwise(cu_seqlens.tolist())
        ]
        return torch.cat(outs, dim=1), None

    return rule


def test_the_fla_path_hands_the_kernels_the_flattened_row_and_its_boundaries(layer, monkeypatch) -> None:
    """With flash-linear-attention and causal-conv1d (CUDA), one call on the micro-batch flattened to one
    row: transformers hands ``cu_seq_lens_q`` to the delta rule and ``seq_idx`` to the conv. Here CPU
    stand-ins with the kernels' calling conventions run it (the kernels need CUDA); every sample's
    output is the layer's on it alone."""
    monkeypatch.setattr(linear_attn_packed, "linear_attention_kernel", lambda device: FLA_CHUNK)
    monkeypatch.setattr(hf_qwen3_5, "causal_conv1d_fn", _conv_standin(hf_qwen3_5.causal_conv1d_fn))
    rule = _rule_standin(hf_qwen3_5.torch_chunk_gated_delta_rule)
    monkeypatch.setattr(hf_qwen3_5, "torch_chunk_gated_delta_rule", rule)
    hidden, mask = _packed(layer.hidden_size)
    with torch.no_grad():
        out = deltanet_forward(
            layer, hidden_states=hidden, attention_mask=mask, cu_seq_lens_q=torch.tensor([0])
        )
        monkeypatch.undo()
        for r, s, e, want in _alone(layer, hidden, mask):
            assert torch.allclose(out[r : r + 1, s:e], want, atol=ATOL), (r, s, e)


def test_a_conv_that_cannot_split_samples_is_refused(layer, monkeypatch) -> None:
    """fla's delta rule without causal-conv1d: the torch conv would mix the samples, so it is refused
    with the fix; an unpacked batch still runs."""
    monkeypatch.setattr(linear_attn_packed, "linear_attention_kernel", lambda device: FLA_CHUNK_TORCH_CONV)
    hidden, mask = _packed(layer.hidden_size)
    with pytest.raises(PlanError, match=r"causal-conv1d.*dhp\[gpu\].*data.packing=false"):
        deltanet_forward(layer, hidden, attention_mask=mask)
    with torch.no_grad():
        deltanet_forward(layer, hidden, attention_mask=(mask != 0).long())
