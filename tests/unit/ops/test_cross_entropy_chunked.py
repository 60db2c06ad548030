"""The one chunked cross-entropy (dhp.ops.cross_entropy) against torch's unchunked F.cross_entropy.

Single process (``group=None``): loss and the gradients w.r.t. hidden states, weight and bias must
equal the unchunked fp32 reference. fp32 on CPU: only the summation order differs (chunk sums, the
log-sum-exp by max + log(sum exp)); measured ~1e-7 relative, asserted <= 1e-6 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dhp.ops.cross_entropy import IGNORE_INDEX, chunked_ce_sum, resolve_chunk_tokens, shifted_ce_sum

RTOL = 1e-6

pytestmark = pytest.mark.unit


def _case(seed: int, *, b: int = 2, s: int = 23, h: int = 16, v: int = 97, ignore: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, h, generator=g, dtype=torch.float64).float()
    weight = torch.randn(v, h, generator=g) * 0.3
    bias = torch.randn(v, generator=g) * 0.1
    labels = torch.randint(0, v, (b, s), generator=g)
    labels[torch.rand(b, s, generator=g) < ignore] = IGNORE_INDEX
    return hidden, weight, bias, labels


def _unchunked(hidden, weight, bias, labels):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def _run(fn, hidden, weight, bias, labels):
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    loss = fn(*leaves, labels)
    (loss * 0.37).backward()  # a non-unit upstream gradient, as loss_sum / T
    return loss.detach(), [t.grad for t in leaves]


def _close(got, want, name):
    err = float((got - want).norm()) / max(float(want.norm()), 1e-12)
    assert err <= RTOL, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("chunk", [1, 5, 7, 16, 4096])  # 7 and 5 do not divide the label count
def test_chunked_ce_equals_unchunked_loss_and_grads(chunk: int) -> None:
    hidden, weight, bias, labels = _case(0)
    want_loss, want = _run(_unchunked, hidden, weight, bias, labels)
    got_loss, got = _run(
        lambda h, w, b, y: shifted_ce_sum(h, w, y, bias=b, chunk_tokens=chunk), hidden, weight, bias, labels
    )
    _close(got_loss, want_loss, f"chunk={chunk} loss")
    for name, g, w in zip(("d/d hidden", "d/d weight", "d/d bias"), got, want, strict=True):
        _close(g, w, f"chunk={chunk} {name}")


def test_chunked_ce_all_ignored_chunks_and_batch() -> None:
    """Whole ignored stretches (image tokens, padding) cost nothing and give exactly zero gradient there;
    a fully ignored micro-batch gives loss 0 and all-zero gradients (not NaN)."""
    hidden, weight, bias, labels = _case(1, s=40, ignore=0.0)
    labels[:, 5:30] = IGNORE_INDEX  # several whole chunks of 4 ignored
    want_loss, want = _run(_unchunked, hidden, weight, bias, labels)
    got_loss, got = _run(
        lambda h, w, b, y: shifted_ce_sum(h, w, y, bias=b, chunk_tokens=4), hidden, weight, bias, labels
    )
    _close(got_loss, want_loss, "loss")
    for g, w in zip(got, want, strict=True):
        _close(g, w, "grad")
    assert torch.count_nonzero(got[0][:, 4:29]) == 0  # hidden rows whose next label is ignored
    none = torch.full_like(labels, IGNORE_INDEX)
    loss, grads = _run(
        lambda h, w, b, y: shifted_ce_sum(h, w, y, bias=b, chunk_tokens=3), hidden, weight, bias, none
    )
    assert float(loss) == 0.0 and all(torch.count_nonzero(g) == 0 for g in grads)


def test_chunked_ce_aligned_targets_and_chunk_default() -> None:
    """``chunked_ce_sum`` takes aligned targets (no shift); 0 picks the documented default chunk."""
    hidden, weight, _, labels = _case(2)
    want = F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), labels.flatten(), reduction="sum")
    _close(chunked_ce_sum(hidden, weight, labels, chunk_tokens=3), want, "aligned")
    assert resolve_chunk_tokens(0) == 4096 and resolve_chunk_tokens(9) == 9
    with pytest.raises(ValueError, match=">= 0"):
        resolve_chunk_tokens(-1)
