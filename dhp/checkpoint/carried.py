"""The untrained parts of a full model directory, carried through an HF export unchanged.

A released omni directory holds the thinker that dhp trains (``thinker.*``) beside modules the family's
graph never builds (the speech output: ``talker.*``, ``token2wav.*`` or ``code2wav.*``). A family names
those as ``checkpoint_keys`` owners outside its ``module_names``. The export writes the trained
thinker tensors under the names the source gave them and copies every carried tensor from the
source's safetensors: read one output shard's worth at a time (``max_shard_bytes``), so peak memory
is about one shard, and written with the dtype, shape and bytes it had.

A source may store the trained module's fused experts one tensor per expert (the released Qwen3-Omni:
``thinker.model.layers.{i}.mlp.experts.{j}.gate_proj.weight``, ``up_proj``, ``down_proj``). The family's
``expert_folds`` (the declaration the loader folds with) group those keys into the fused tensor they
stand for; the export writes the trained fused tensor back cut into them (:class:`PerExpert`), under the
source's own keys. The carried modules' experts (the talker's) stay as stored.

Only the safetensors headers are read to plan (names, dtypes, shapes, byte sizes); a tensor's data is
read when its output shard is written.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from dhp.errors import CheckpointError
from dhp.models.family import ModelFamily
from dhp.models.loading import FoldedKey, StackedExperts, fold_experts

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
class PerExpert:
    """A trained fused expert tensor the source stores one tensor per expert: ``folded.keys[j]`` are
    expert ``j``'s part keys, each ``sizes[i]`` long on ``folded.fold.dim``."""

    folded: FoldedKey
    sizes: tuple[int, ...]

    def split(self, fused: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{source key: tensor}`` of every expert's parts of ``fused`` (copies: ``fused`` can be dropped)."""
        if fused.shape[0] != len(self.folded.keys):
            raise CheckpointError(
                f"{self.folded.layer}: the trained tensor holds {fused.shape[0]} experts, the source "
                f"{len(self.folded.keys)}. Fix: export with the model.path the run was trained from."
            )
        return {
            k: t
            for keys, ts in zip(self.folded.keys, self.folded.fold.unfold(fused, self.sizes), strict=True)
            for k, t in zip(keys, ts, strict=True)
        }


@dataclass(frozen=True)
class FullSource:
    """A full model directory: ``names`` maps each trained tensor ``(module, module_fqn)`` to the key
    the source stores it under (for a fused expert tensor stored per expert: the fused key the parts
    fold into, its shape the stacked one, and ``per_expert[key]`` its parts); ``carried`` lists the
    other modules' tensors in file order."""

    names: dict[tuple[str, str], SourceTensor]
    carried: tuple[SourceTensor, ...]
    per_expert: dict[str, PerExpert] = field(default_factory=dict)


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
    trained, carried, unowned = {}, [], []
    for key, tensor in source_tensors(path).items():
        owner = family.checkpoint_owner(key)
        if owner is None:
            unowned.append(key)
        elif owner[0] in graph:
            trained[key] = tensor
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
    names, per_expert = _fold_trained(family, path, trained)
    return FullSource(
        names=names, carried=tuple(sorted(carried, key=lambda t: (str(t.file), t.key))), per_expert=per_expert
    )


class _Header:
    """A source tensor's shape as :class:`StackedExperts` asks a lazy slice for it (no data)."""

    def __init__(self, tensor: SourceTensor) -> None:
        self.shape = tensor.shape

    def get_shape(self) -> list[int]:
        return list(self.shape)


def _fold_trained(
    family: ModelFamily, path: Path, trained: dict[str, SourceTensor]
) -> tuple[dict[tuple[str, str], SourceTensor], dict[str, PerExpert]]:
    """``(names, per_expert)`` of the trained modules' source tensors: each layer's per-expert keys of
    the family's ``expert_folds`` (the loader's grouping, :func:`~dhp.models.loading.fold_experts`)
    stand as the fused tensor they fold into, shaped from the headers. CheckpointError (the loader's)
    when a layer lacks some experts or parts, or the parts' shapes disagree."""
    rest, folded = fold_experts({k: k for k in trained}, getattr(family, "expert_folds", ()), path)
    per_expert = {}
    for fused_key, fk in folded.items():
        stacked = StackedExperts(fk, lambda k: _Header(trained[k]), where=str(path))
        first = trained[fk.keys[0][0]]
        nbytes = sum(trained[k].nbytes for keys in fk.keys for k in keys)
        trained[fused_key] = SourceTensor(fused_key, first.file, stacked.shape, nbytes)
        per_expert[fused_key] = PerExpert(folded=fk, sizes=tuple(stacked.sizes))
    names = {}
    for key in rest:
        owner = family.checkpoint_owner(key)
        if owner is None:  # a fused key no module owns although its parts are: the family's mapping is off
            raise CheckpointError(
                f"{path}: {key}, the fused tensor of its per-expert keys, belongs to no {family.name} "
                "module. Fix: the family's checkpoint key mapping must own the fused name too."
            )
        names[owner] = trained[key]
    return names, per_expert


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
