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
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dhp.errors import CheckpointError
from dhp.models.common import tie_parameters
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
    index = checkpoint_index(model_dir)
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
        targets, key_of, index, Path(model_dir), dtype=dtype, shard_fn=shard_fn, family=family
    )
    tie_parameters(module, tied)
    family.init_buffers(module_name, module)  # the rotary tables, and any other buffer the family recomputes
    return LoadReport(
        keys_read=tuple(sorted(key_of.values())), files_opened=tuple(sorted(files)), bytes_read=nbytes
    )


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
) -> tuple[set[str], int]:
    """Copy each needed tensor from its file into ``targets``; returns the files opened and bytes read."""
    stored_dims = getattr(family, "stored_dims", None)  # optional: only families with a re-laid-out tensor
    nbytes = 0
    by_file: dict[str, list[str]] = {}
    for fqn, key in key_of.items():
        by_file.setdefault(index[key], []).append(fqn)
    with torch.no_grad():
        for file_name, fqns in sorted(by_file.items()):
            with safe_open(str(root / file_name), framework="pt") as f:
                for fqn in fqns:
                    target = targets[fqn]
                    full = f.get_slice(key_of[fqn])
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
                            f"{root / file_name}: {key_of[fqn]} has shape {tuple(value.shape)} but "
                            f"{fqn} expects {tuple(local.shape)}. Fix: config.json must match the weights."
                        )
                    nbytes += value.numel() * value.element_size()
                    cast = dtype if value.is_floating_point() else value.dtype
                    local.copy_(value.to(cast))
    return set(by_file), nbytes


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
