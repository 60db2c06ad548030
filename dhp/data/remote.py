"""Pixel rows that stay in Ray's object store until the vision rank that encodes them reads them.

With ``data.engine=ray`` a data worker returns each sample's ``pixel_values`` as its own object
(owned by the driver, stored where the worker ran). The driver's samples, batches and SP shards carry
a :class:`RemoteRows` in their place: a list of ``(object, first row, end row)`` segments and an
optional row selection. It behaves like a ``(rows, width)`` float32 tensor for the operations the
routing does (``torch.cat``, slicing, ``index_select``, ``shape``), so the routing code is the same
for both engines, but it holds no pixel byte. :func:`resolve_pixels` (on the vision rank) fetches
the objects and builds the real tensor: the only copy of the rows outside the object store.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch


class RemoteRows:
    """``(num_rows, width)`` float32 pixel rows in the object store; no data on this process."""

    dtype = torch.float32
    device = torch.device("cpu")
    ndim = 2

    def __init__(
        self, segments: tuple[tuple[Any, int, int], ...], width: int, index: torch.Tensor | None = None
    ):
        self.segments = tuple(segments)
        self.width = int(width)
        self.index = index

    @property
    def num_stored(self) -> int:
        """Rows of the segments before the selection."""
        return sum(b - a for _, a, b in self.segments)

    @property
    def shape(self) -> torch.Size:
        rows = self.num_stored if self.index is None else int(self.index.numel())
        return torch.Size((rows, self.width))

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: slice) -> RemoteRows:
        if not isinstance(key, slice) or key.step not in (None, 1) or self.index is not None:
            raise TypeError("RemoteRows supports contiguous row slices of unselected rows only")
        lo, hi, _ = key.indices(self.num_stored)
        out, pos = [], 0
        for ref, a, b in self.segments:
            n = b - a
            s, e = max(lo, pos), min(hi, pos + n)
            if s < e:
                out.append((ref, a + s - pos, a + e - pos))
            pos += n
        return RemoteRows(tuple(out), self.width)

    def index_select(self, dim: int, index: torch.Tensor) -> RemoteRows:
        if dim != 0:
            raise TypeError("RemoteRows selects rows (dim 0) only")
        index = index.to(torch.long)
        return RemoteRows(self.segments, self.width, index if self.index is None else self.index[index])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.cat and not (kwargs or {}).get("dim", args[1] if len(args) > 1 else 0):
            parts = list(args[0])
            if all(isinstance(p, RemoteRows) and p.index is None for p in parts):
                return RemoteRows(tuple(s for p in parts for s in p.segments), parts[0].width)
        raise TypeError(f"RemoteRows does not support {getattr(func, '__name__', func)}")

    def resolve(self) -> torch.Tensor:
        """The rows as a CPU tensor: fetch each object once, copy the needed rows once."""
        import ray

        refs = list({id(r): r for r, _, _ in self.segments}.values())
        arrays = dict(zip((id(r) for r in refs), ray.get(refs), strict=True))
        if not self.segments:
            return torch.empty((0, self.width), dtype=self.dtype)
        rows = np.concatenate([arrays[id(r)][a:b] for r, a, b in self.segments])  # writable copy
        out = torch.from_numpy(rows)
        return out if self.index is None else out.index_select(0, self.index)


def resolve_pixels(shard: Any) -> Any:
    """``shard`` (a producer's input shard, or None) with :class:`RemoteRows` pixels replaced by the
    real rows; a shard without pixels (an audio shard) as it is."""
    if shard is None or not isinstance(getattr(shard, "pixel_values", None), RemoteRows):
        return shard
    return dataclasses.replace(shard, pixel_values=shard.pixel_values.resolve())


def as_tensor(pixels: Any) -> Any:
    """``pixels`` as a tensor (fetched when it is :class:`RemoteRows`): for single-process references
    such as ``dhp verify``, which run the whole model on the driver anyway."""
    return pixels.resolve() if isinstance(pixels, RemoteRows) else pixels
