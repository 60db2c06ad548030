"""The per-rank accountant counts exactly the bytes a hand-counted toy holds, phase by phase."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dhp.metrics.accounting import MemoryAccountant, unique_storage_bytes

B, D_IN, H, D_OUT = 3, 4, 8, 2  # batch, in, hidden, out


def _toy() -> tuple[nn.Module, torch.optim.Optimizer, MemoryAccountant]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(D_IN, H), nn.ReLU(), nn.Linear(H, D_OUT))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    return m, opt, MemoryAccountant(lambda: m, lambda: opt)


P = (D_IN * H + H) + (H * D_OUT + D_OUT)  # parameters of the toy


def test_saved_bytes_of_a_two_layer_toy_are_counted_exactly() -> None:
    m, opt, acct = _toy()
    x = torch.randn(B, D_IN)
    with acct.saving():
        y = m(x)
    # saved: x (addmm of layer 1 needs it for the weight grad) and the ReLU output (ReLU's backward
    # and layer 2's weight grad share that one storage); weights are parameters, never counted twice
    expected_saved = 4 * (B * D_IN + B * H)
    t = acct.terms()
    assert t == {"params": 4 * P, "grads": 0, "optimizer": 0, "saved": expected_saved}
    y.sum().backward()
    del y  # the graph is freed: nothing saved is alive any more
    t = acct.terms()
    assert t == {"params": 4 * P, "grads": 4 * P, "optimizer": 0, "saved": 0}
    opt.step()
    acct.sample()
    # AdamW: exp_avg + exp_avg_sq per parameter (fp32) and a 0-d fp32 step per parameter tensor
    assert acct.terms()["optimizer"] == 4 * 2 * P + 4 * 4
    peak = acct.take()
    assert peak["total"] == 4 * P * 4 + 16  # params + grads + states after the step (largest sample)
    assert acct.take() == {"total": 0}  # a new window


def test_checkpointed_block_saves_only_its_input() -> None:
    m, _, acct = _toy()
    x = torch.randn(B, D_IN, requires_grad=True)
    with acct.saving():
        y = checkpoint(m, x, use_reentrant=False)
    assert acct.terms()["saved"] == 4 * B * D_IN  # the block input alone; the inside is recomputed
    y.sum().backward()


def test_selective_checkpointing_counts_the_outputs_its_cache_keeps() -> None:
    """Selective AC keeps the matmul outputs in its own cache, not through autograd's hooks: the
    accountant counts them while the region's graph lives, and nothing once backward consumed them."""
    from dhp.parallel.ac import selective_context

    m, _, acct = _toy()
    x = torch.randn(B, D_IN, requires_grad=True)
    with acct.saving():
        y = checkpoint(m, x, use_reentrant=False, context_fn=selective_context)
    # the block input, and the two addmm outputs (B x H, B x D_OUT); the ReLU is recomputed
    assert acct.terms()["saved"] == 4 * (B * D_IN + B * H + B * D_OUT)
    y.sum().backward()
    del y
    assert acct.terms()["saved"] == 0


def test_views_share_one_storage_and_excluded_pointers_are_skipped() -> None:
    a = torch.zeros(10)
    assert unique_storage_bytes([a, a[2:5], a.view(2, 5)]) == 40
    assert unique_storage_bytes([a, torch.zeros(3)], exclude={a.untyped_storage().data_ptr()}) == 12


def test_opt_in_through_the_environment(tmp_path, monkeypatch) -> None:
    import json

    from dhp.metrics import accounting

    m, opt, _ = _toy()
    monkeypatch.delenv(accounting.ENV_VAR, raising=False)
    assert accounting.from_env(lambda: m, lambda: opt) is None  # off: the worker pays nothing
    assert accounting.flush(None, module_name="llm", rank=0) is None
    monkeypatch.setenv(accounting.ENV_VAR, str(tmp_path))
    acct = accounting.from_env(lambda: m, lambda: opt)
    with accounting.saving(acct):  # samples on exit: the forward's saved tensors are alive
        y = m(torch.randn(B, D_IN))
    y.sum().backward()
    accounting.sample(acct)  # params + grads (4P each) > params + saved (4P + 144 B): the peak
    accounting.flush(acct, module_name="llm", rank=1)
    (row,) = [json.loads(x) for x in (tmp_path / "llm_1.jsonl").read_text().splitlines()]
    assert row == {"total": 8 * P, "params": 4 * P, "grads": 4 * P, "optimizer": 0, "saved": 0}
    assert 4 * (B * D_IN + B * H) < 4 * P  # so the forward's sample was not the window's largest
