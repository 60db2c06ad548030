"""Load one module's weights from a local HF directory, reading only that module's tensors.

The module is built on ``meta`` (no memory), then ``to_empty`` on the target device, then each of
its tensors is read with ``safetensors.safe_open`` straight from the file that holds it (single
``model.safetensors`` or shards listed in ``model.safetensors.index.json``). The other modules'
tensors are never read. A TP rank passes ``shard_fn`` to pull only its slice from the file.

A checkpoint may store a tensor in another dimension order than the module holds it (the released
Qwen3-VL-MoE experts: ``[E, H, 2I]`` on disk, ``[E, 2I, H]`` in transformers 5). A family that knows
such a layout has the optional method ``stored_dims(fqn, stored_shape, shape) -> dims | None``
(``stored.permute(dims)`` is the module's layout; None: the same layout): the loader then reads the
rank's slice in the stored order and permutes it, so an expert-parallel rank still reads only its rows.

A checkpoint may also store a fused expert tensor as one tensor per expert (the released Qwen3.5-MoE and
Qwen3-Omni: ``...mlp.experts.{j}.gate_proj.weight``, ``up_proj``, ``down_proj``). A family that declares
``expert_folds`` (:class:`~dhp.models.common.ExpertFold`) has them folded: where a layer's fused key is
absent but its per-expert keys are present, the loader reads the fused tensor through
:class:`StackedExperts`, which reads only the experts (and rows) a rank's slice covers and stacks them,
one fused tensor at a time. The per-expert keys count as read (``LoadReport.keys_read`` names them); a
layer that lacks some experts, or some parts of one, is a CheckpointError naming the layer and experts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dhp.errors import CheckpointError
from dhp.models.common import ExpertFold, tie_parameters
from dhp.models.family import ModelFamily

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# shard_fn(fqn, param, full) -> the tensor this rank keeps for ``fqn``. ``full`` is safetensors'
# lazy slice (``full[a:b]``, ``full.get_shape()``) so only the kept rows/columns are read. Without
# one, ``own_slice`` is used: whole tensors, or a DTensor parameter's local shard.
ShardFn = Callable[[str, torch.Tensor, Any], torch.Tensor]


@dataclass(frozen=True)
class LoadReport:
    """What a load read: checkpoint keys (sorted), the files opened, and the tensor bytes read.

    ``bytes_read`` counts only the slices taken from the files (in the checkpoint's dtype), so a TP or
    FSDP rank that loads its local shards reports about ``1/degree`` of the sharded tensors' bytes.
    """

    keys_read: tuple[str, ...]
    files_opened: tuple[str, ...]
    bytes_read: int = 0


def own_slice(target: torch.Tensor, full: Any) -> torch.Tensor:
    """Read from the lazy safetensors slice only what ``target`` holds on this rank.

    A plain tensor takes the whole tensor. A DTensor (parameters already distributed, e.g. by TP on
    the meta device) takes its local shard, located from its mesh and placements: a TP rank reads
    1/tp of each sharded weight from disk and never materialises the full tensor.
    """
    if not isinstance(target, DTensor):
        return full[:]
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


def permuted_slice(target: torch.Tensor, full: Any, dims: tuple[int, ...]) -> torch.Tensor:
    """:func:`own_slice` of a tensor stored with its dimensions in another order: ``stored.permute(dims)``
    has ``target``'s layout. Reads only this rank's slice (module dim ``i`` is stored dim ``dims[i]``)."""
    if isinstance(target, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            target.shape, target.device_mesh, target.placements
        )
    else:
        shape, offset = tuple(target.shape), (0,) * target.dim()
    stored: list[slice] = [slice(None)] * len(dims)
    for i, d in enumerate(dims):
        stored[d] = slice(offset[i], offset[i] + shape[i])
    return full[tuple(stored)].permute(*dims).contiguous()


@dataclass(frozen=True)
class FoldedKey:
    """A fused expert tensor the checkpoint stores per expert: ``keys[j]`` are expert ``j``'s part keys
    (in the fold's order), concatenated on ``dim``; ``layer`` is the key prefix, for messages."""

    layer: str
    fold: ExpertFold
    keys: tuple[tuple[str, ...], ...]

    def missing_experts(self, num_experts: int) -> list[int]:
        """Experts ``>= len(keys)`` of a module that holds ``num_experts``."""
        return list(range(len(self.keys), num_experts))


def fold_experts(
    index: dict[str, str], folds: Sequence[ExpertFold], model_dir: str | Path
) -> tuple[dict[str, str], dict[str, FoldedKey]]:
    """``index`` with each layer's per-expert keys replaced by the fused key they fold into (mapped to
    the file of its first part), and ``{fused_key: FoldedKey}``. Reads no tensor. CheckpointError when
    a layer lacks some experts or some parts of one (every part of experts ``0 .. max`` must be there),
    or stores both the fused key and per-expert keys."""
    if not folds:
        return index, {}
    patterns = [
        (
            fold,
            re.compile(
                rf"^((?:.*\.)?){re.escape(fold.experts)}\.(\d+)\.({'|'.join(map(re.escape, fold.parts))})$"
            ),
        )
        for fold in folds
    ]
    found: dict[str, tuple[str, ExpertFold, dict[tuple[int, str], str]]] = {}
    rest = {}
    for key, file_name in index.items():
        for fold, pattern in patterns:
            m = pattern.match(key)
            if m is not None:
                layer, j, part = m.group(1), int(m.group(2)), m.group(3)
                found.setdefault(layer + fold.fused, (layer, fold, {}))[2][(j, part)] = key
                break
        else:
            rest[key] = file_name
    folded = {}
    for fused_key, (layer, fold, parts) in sorted(found.items()):
        if fused_key in rest:
            raise CheckpointError(
                f"{model_dir}: {fused_key!r} is stored both fused and per expert "
                f"({layer}{fold.experts}.<j>.*). Fix: keep one layout."
            )
        count = 1 + max(j for j, _ in parts)
        lacking = {p: [j for j in range(count) if (j, p) not in parts] for p in fold.parts}
        lacking = {p: js for p, js in lacking.items() if js}
        if lacking:
            raise CheckpointError(
                f"{model_dir}: layer {layer!r} stores its experts one tensor per expert but lacks "
                + "; ".join(f"{layer}{fold.experts}.<j>.{p} of experts {js}" for p, js in lacking.items())
                + f" (experts 0..{count - 1} present otherwise). Fix: the checkpoint is incomplete; "
                "download the missing shard files again."
            )
        keys = tuple(tuple(parts[(j, p)] for p in fold.parts) for j in range(count))
        folded[fused_key] = FoldedKey(layer=layer, fold=fold, keys=keys)
        rest[fused_key] = index[keys[0][0]]
    return rest, folded


class StackedExperts:
    """The fused tensor of a :class:`FoldedKey` as a lazy slice (safetensors' ``get_shape()`` and
    ``[slices]``, one unit-step slice per dim): ``[experts, rows, cols]`` reads, for each expert the
    slice covers, only the part of each per-expert tensor that falls in it (a part lies on ``dim`` after
    the ones before it) straight into the result. An EP rank's slice of experts reads those experts'
    tensors only; the result (this rank's slice) is the only buffer, plus one part being copied."""

    def __init__(self, folded: FoldedKey, lazy: Callable[[str], Any], where: str) -> None:
        self.folded, self.dim = folded, folded.fold.dim
        self.parts = [[lazy(k) for k in keys] for keys in folded.keys]
        first = [tuple(p.get_shape()) for p in self.parts[0]]
        for j, expert in enumerate(self.parts):
            shapes = [tuple(p.get_shape()) for p in expert]
            others = {s[: self.dim] + s[self.dim + 1 :] for s in shapes}
            if shapes != first or len(others) != 1:
                raise CheckpointError(
                    f"{where}: expert {j} of {folded.layer!r} has part shapes {shapes} "
                    f"({folded.fold.parts}); expert 0 has {first}. Fix: config.json must match the weights."
                )
        self.sizes = [s[self.dim] for s in first]
        inner = list(first[0])
        inner[self.dim] = sum(self.sizes)
        self.shape = (len(self.parts), *inner)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, key: Any) -> torch.Tensor:
        key = key if isinstance(key, tuple) else (key,)
        key = key + (slice(None),) * (len(self.shape) - len(key))
        if len(key) != len(self.shape) or any(
            not isinstance(k, slice) or k.step not in (None, 1) for k in key
        ):
            raise TypeError(f"StackedExperts takes one unit-step slice per dim, got {key}")
        ranges = [range(n)[k] for n, k in zip(self.shape, key, strict=True)]
        rows = ranges[1 + self.dim]
        dtype = self.parts[0][0][tuple(slice(0, 0) for _ in self.shape[1:])].dtype
        out = torch.empty([len(r) for r in ranges], dtype=dtype)
        sel = [slice(r.start, r.stop) for r in ranges[1:]]
        for i, expert in enumerate(self.parts[key[0]]):
            start = 0
            for part, size in zip(expert, self.sizes, strict=True):
                a, b = max(rows.start, start), min(rows.stop, start + size)
                if a < b:
                    sel[self.dim] = slice(a - start, b - start)
                    out[i].narrow(self.dim, a - rows.start, b - a).copy_(part[tuple(sel)])
                start += size
        return out


def checkpoint_index(model_dir: str | Path) -> dict[str, str]:
    """``{checkpoint_key: file_name}`` of a HF directory (single file or sharded), headers only."""
    root = Path(model_dir)
    if (root / INDEX_FILE).is_file():
        weight_map = json.loads((root / INDEX_FILE).read_text())["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (root / f).is_file()})
        if missing:
            raise CheckpointError(f"{root / INDEX_FILE} lists shard files that do not exist: {missing}")
        return dict(weight_map)
    if (root / SINGLE_FILE).is_file():
        with safe_open(str(root / SINGLE_FILE), framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)
    present = sorted(p.name for p in root.iterdir()) if root.is_dir() else "directory missing"
    raise CheckpointError(
        f"{root}: neither {SINGLE_FILE} nor {INDEX_FILE} found (present: {present}). "
        f"Fix: point model.path at a HF directory saved with safetensors."
    )


def module_key_map(
    family: ModelFamily, module_name: str, index: dict[str, str], model_dir: str | Path
) -> dict[str, str]:
    """``{module_fqn: checkpoint_key}`` of the keys this module owns; a key owned by no module is an error."""
    owned: dict[str, str] = {}
    unowned = []
    for key in index:
        owner = family.checkpoint_owner(key)
        if owner is None:
            unowned.append(key)
        elif owner[0] == module_name:
            if owner[1] in owned:
                raise CheckpointError(
                    f"{model_dir}: {owned[owner[1]]!r} and {key!r} both hold {module_name}.{owner[1]} "
                    f"(old and new key layouts mixed). Fix: keep one layout."
                )
            owned[owner[1]] = key
    if unowned:
        raise CheckpointError(
            f"{model_dir}: unexpected keys that belong to no module of {family.name}: {sorted(unowned)}. "
            f"Fix: check that model.family matches the checkpoint."
        )
    return owned


def load_module_weights(
    module: nn.Module,
    model_dir: str | Path,
    *,
    family: ModelFamily,
    module_name: str,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    shard_fn: ShardFn | None = None,
) -> LoadReport:
    """Materialise a meta-built ``module`` on ``device`` and fill it from ``model_dir``.

    Reads only the checkpoint keys this module owns. Missing or unexpected keys raise a
    CheckpointError listing all of them. Floating tensors are cast to ``dtype``, the dtype the module
    stores its parameters in (the precision policy's, ``dhp.parallel.precision``), whatever the files
    hold: a bf16 checkpoint is upcast to fp32 master weights as each slice is read (a transient of one
    slice in the file's dtype; ``bytes_read`` counts the file's bytes), an fp32 one rounded to bf16.
    Non-persistent buffers are recomputed by the family; tied parameters are re-tied. Parameters that
    are already DTensors (TP applied on meta) receive only their local shard (see ``own_slice``).
    """
    stored = checkpoint_index(model_dir)
    index, folded = fold_experts(stored, getattr(family, "expert_folds", ()), model_dir)
    key_of = module_key_map(family, module_name, index, model_dir)
    tied = family.tied_parameters(module_name, hf_config)
    # peft LoRA: a wrapped layer's weights load into ``X.base_layer``; the adapters are not in the files
    targets = {_strip_lora(k): v for k, v in module.state_dict(keep_vars=True).items() if not _is_adapter(k)}
    expected = {k for k in targets if k not in tied}
    for fqn in tied:  # a tied checkpoint may still store the copy: it is ignored, not unexpected
        key_of.pop(fqn, None)
    # a pipeline stage (dhp.parallel.pipeline) holds its own layers: the others' keys are not its to read
    others = {_strip_lora(k) for k in getattr(module, "pipeline_dropped", ())}
    for fqn in others:
        key_of.pop(fqn, None)
    missing, unexpected = sorted(expected - key_of.keys()), sorted(key_of.keys() - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{model_dir}: module {module_name!r} of {family.name} does not match the checkpoint. "
            f"missing keys ({len(missing)}): {missing}; unexpected keys ({len(unexpected)}): "
            f"{[key_of[k] for k in unexpected]}. Fix: the config.json architecture must match the weights."
        )
    module.to_empty(device=device)
    targets = {_strip_lora(k): v for k, v in module.state_dict(keep_vars=True).items() if not _is_adapter(k)}
    files, nbytes = _read_into(
        targets, key_of, stored, Path(model_dir), dtype=dtype, shard_fn=shard_fn, family=family, folded=folded
    )
    tie_parameters(module, tied)
    family.init_buffers(module_name, module)  # the rotary tables, and any other buffer the family recomputes
    read = [k for key in key_of.values() for k in _stored_keys(key, folded)]
    return LoadReport(keys_read=tuple(sorted(read)), files_opened=tuple(sorted(files)), bytes_read=nbytes)


def _expert_count_error(root: Path, fqn: str, folded: FoldedKey, num_experts: int) -> str:
    stored = len(folded.keys)
    what = (
        f"experts {folded.missing_experts(num_experts)} are missing. Fix: the checkpoint is incomplete; "
        "download the missing shard files again."
        if stored < num_experts
        else "Fix: config.json's number of experts must match the weights."
    )
    return (
        f"{root}: layer {folded.layer!r} stores experts 0..{stored - 1} one tensor per expert "
        f"({folded.layer}{folded.fold.experts}.<j>.*) but {fqn} holds {num_experts}: {what}"
    )


def _stored_keys(key: str, folded: dict[str, FoldedKey]) -> list[str]:
    """The checkpoint keys that hold ``key``: itself, or a folded key's per-expert keys."""
    return [k for keys in folded[key].keys for k in keys] if key in folded else [key]


def _strip_lora(fqn: str) -> str:
    return fqn.replace(".base_layer.", ".")


def _is_adapter(fqn: str) -> bool:
    return ".lora_A." in fqn or ".lora_B." in fqn


def _read_into(
    targets: dict[str, torch.Tensor],
    key_of: dict[str, str],
    index: dict[str, str],
    root: Path,
    *,
    dtype: torch.dtype,
    shard_fn: ShardFn | None,
    family: ModelFamily,
    folded: dict[str, FoldedKey],
) -> tuple[set[str], int]:
    """Copy each needed tensor from its file into ``targets``; returns the files opened and bytes read.

    Tensors are read in file order, each file opened once (and kept open until the end: a folded
    expert tensor reads its experts from whichever files hold them); at most one tensor's local slice
    (a folded one: one layer's local experts) is held beside the targets at a time."""
    stored_dims = getattr(family, "stored_dims", None)  # optional: only families with a re-laid-out tensor
    nbytes = 0
    handles: dict[str, Any] = {}
    with ExitStack() as stack, torch.no_grad():

        def lazy(key: str) -> Any:
            name = index[key]
            if name not in handles:
                handles[name] = stack.enter_context(safe_open(str(root / name), framework="pt"))
            return handles[name].get_slice(key)

        def first_file(item: tuple[str, str]) -> str:
            return index[_stored_keys(item[1], folded)[0]]

        for fqn, key in sorted(key_of.items(), key=lambda item: (first_file(item), item[0])):
            target = targets[fqn]
            where = str(root / first_file((fqn, key)))
            full = StackedExperts(folded[key], lazy, where) if key in folded else lazy(key)
            if key in folded and full.shape[0] != target.shape[0]:
                raise CheckpointError(_expert_count_error(root, fqn, folded[key], target.shape[0]))
            dims = None
            if stored_dims is not None:
                dims = stored_dims(fqn, tuple(full.get_shape()), tuple(target.shape))
            if dims is not None:
                value = permuted_slice(target, full, dims)
            elif shard_fn is not None:
                value = shard_fn(fqn, target, full)
            else:
                value = own_slice(target, full)
            local = target._local_tensor if isinstance(target, DTensor) else target
            if tuple(value.shape) != tuple(local.shape):
                raise CheckpointError(
                    f"{where}: {key} has shape {tuple(value.shape)} but "
                    f"{fqn} expects {tuple(local.shape)}. Fix: config.json must match the weights."
                )
            nbytes += value.numel() * value.element_size()
            cast = dtype if value.is_floating_point() else value.dtype
            local.copy_(value.to(cast))
            del value
    return set(handles), nbytes


def build_and_load(
    family: ModelFamily,
    module_name: str,
    model_dir: str | Path,
    *,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[nn.Module, LoadReport]:
    """Build ``module_name`` on meta and load only its tensors from ``model_dir`` onto ``device``.

    Peak memory: this module's weights once, on ``device``; the other modules are never touched.
    """
    module = family.build_module(module_name, hf_config, device="meta", dtype=dtype)
    report = load_module_weights(
        module,
        model_dir,
        family=family,
        module_name=module_name,
        hf_config=hf_config,
        dtype=dtype,
        device=device,
    )
    return module, report
