"""The untrained parts of a full model directory, carried through an HF export unchanged.

A released omni directory holds the thinker that dhp trains (``thinker.*``) beside modules the family's
graph never builds (the speech output: ``talker.*``, ``token2wav.*`` or ``code2wav.*``). A family names
those as ``checkpoint_keys`` owners outside its ``module_names``. The export writes the trained
thinker tensors under the names the source gave them and copies every carried tensor from the
source's safetensors: read one output shard's worth at a time (``max_shard_bytes``), so peak memory
is about one shard, and written with the dtype, shape and bytes it had.

Only the safetensors headers are read to plan (names, dtypes, shapes, byte sizes); a tensor's data is
read when its output shard is written.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from dhp.errors import CheckpointError
from dhp.models.family import ModelFamily

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of the source directory: its key, the file that holds it, its shape and byte size."""

    key: str
    file: Path
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class FullSource:
    """A full model directory: ``names`` maps each trained tensor ``(module, module_fqn)`` to the key
    the source stores it under; ``carried`` lists the other modules' tensors in file order."""

    names: dict[tuple[str, str], SourceTensor]
    carried: tuple[SourceTensor, ...]


def _header(file: Path) -> dict[str, dict]:
    """The safetensors header of ``file`` (``{key: {"dtype", "shape", "data_offsets"}}``), data unread."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def source_tensors(path: Path) -> dict[str, SourceTensor]:
    """Every tensor of the HF directory ``path`` (``model.safetensors`` or the shards its index lists);
    empty when it holds neither."""
    index = path / INDEX_FILE
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:  # no weights (a config-only directory): nothing to carry
        return {}
    out = {}
    for name in files:
        for key, info in _header(path / name).items():
            begin, end = info["data_offsets"]
            out[key] = SourceTensor(key, path / name, tuple(info["shape"]), end - begin)
    return out


def full_source(family: ModelFamily, path: Path) -> FullSource | None:
    """``path``'s tensors split into the family's modules and the carried ones; None when every tensor
    belongs to the family's graph or to no module (a thinker-only directory: the export writes the
    family's own keys, as before). In a full directory, CheckpointError names any key that belongs to
    no module (the rebuilt directory would lack it)."""
    graph = set(family.module_names)
    names, carried, unowned = {}, [], []
    for key, tensor in source_tensors(path).items():
        owner = family.checkpoint_owner(key)
        if owner is None:
            unowned.append(key)
        elif owner[0] in graph:
            names[owner] = tensor
        else:
            carried.append(tensor)
    if not carried:
        return None
    if unowned:
        raise CheckpointError(
            f"{path}: {len(unowned)} tensor(s) belong to no {family.name} module, e.g. {sorted(unowned)[:5]}; "
            "a rebuilt full model would drop them. Fix: point model.path at the directory the run was "
            "trained from."
        )
    return FullSource(names=names, carried=tuple(sorted(carried, key=lambda t: (str(t.file), t.key))))


def batches(tensors: tuple[SourceTensor, ...], max_bytes: int) -> list[list[SourceTensor]]:
    """``tensors`` cut in order into runs of at most ``max_bytes`` (a larger tensor goes alone)."""
    out: list[list[SourceTensor]] = []
    cur: list[SourceTensor] = []
    size = 0
    for t in tensors:
        if cur and size + t.nbytes > max_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    if cur:
        out.append(cur)
    return out


def read_carried(batch: list[SourceTensor]) -> dict[str, torch.Tensor]:
    """The tensors of ``batch`` as the source stores them (each file opened once)."""
    out = {}
    for file in sorted({t.file for t in batch}):
        with safe_open(str(file), framework="pt") as f:
            for t in batch:
                if t.file == file:
                    out[t.key] = f.get_tensor(t.key)
    return out
