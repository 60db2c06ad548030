"""``data.eval.split``: a seeded share of every training dataset's records, held out of training.

Per dataset ``d`` of ``n`` records, ``round(split * n)`` of them (at least 1 when ``split > 0`` and
``n >= 2``; at most ``n - 1``, so training keeps one) are chosen by a permutation seeded with
``(train.seed, d)``: the same records for the same seed, data and split, whatever the plan, the
resume or the epoch. The training stream never sees them (its epoch is the kept records); the eval
pass reads each once. Pure; runs on the driver and holds only index lists.
"""

from __future__ import annotations

import torch

from dhp.data.batch import Sample

_SEED_STRIDE = 7919
_SALT = 104_729  # keeps the split's permutation apart from the epoch orders' (dhp.data.source)


def held_out(sizes: list[int], *, split: float, seed: int) -> list[list[int]]:
    """Per dataset, the sorted local indices held out for evaluation (see the module docstring)."""
    out = []
    for d, n in enumerate(sizes):
        k = round(split * n)
        if split > 0 and n >= 2:
            k = min(max(k, 1), n - 1)
        elif n < 2:
            k = 0
        gen = torch.Generator().manual_seed(seed * _SEED_STRIDE + _SALT + d)
        out.append(sorted(int(i) for i in torch.randperm(n, generator=gen)[:k]))
    return out


class SubsetSource:
    """Some records of each dataset of a source, behind one index ``0..len-1`` (dataset after
    dataset, as the source's own index: :func:`dhp.data.source.epoch_order` reads its ``sizes``)."""

    def __init__(self, source, keep: list[list[int]], sizes: list[int]) -> None:
        self.source = source
        self.sizes = [len(k) for k in keep]
        starts = [sum(sizes[:d]) for d in range(len(sizes))]
        self._index = [starts[d] + i for d, k in enumerate(keep) for i in k]
        self.processor = getattr(source, "processor", None)  # what `dhp data check --show` reads

    def __len__(self) -> int:
        return len(self._index)

    def location(self, index: int) -> str:
        return self.source.location(self._index[index])

    def load(self, index: int) -> Sample:
        return self.source.load(self._index[index])


def split_source(source, sizes: list[int], *, split: float, seed: int) -> tuple[SubsetSource, SubsetSource]:
    """``(training part, eval part)`` of ``source`` under ``data.eval.split``."""
    held = held_out(sizes, split=split, seed=seed)
    kept = [sorted(set(range(n)) - set(h)) for n, h in zip(sizes, held, strict=True)]
    return SubsetSource(source, kept, sizes), SubsetSource(source, held, sizes)
