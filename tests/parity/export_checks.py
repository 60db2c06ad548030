"""Shared steps of the omni export tests: a dhp checkpoint of a reference thinker's three modules, and
what a rebuilt full directory must hold against its source."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dhp.checkpoint import (
    CheckpointMeta,
    ModuleRecord,
    begin_checkpoint,
    commit_checkpoint,
    save_module_state,
)


def checkpoint_of(family, hf_config, ref: nn.Module, root: Path, *, step: int = 3) -> Path:
    """A committed dhp checkpoint (DCP per module, as training writes it) of ``ref``'s weights, cut
    into the family's modules by ``split_state_dict``."""
    parts = family.split_state_dict(ref.state_dict())
    tmp = begin_checkpoint(root, step=step)
    for name in family.module_names:
        module = family.build_module(name, hf_config, device="cpu", dtype=torch.float32)
        module.load_state_dict(parts[name], strict=True)
        save_module_state(tmp / name, model=module, optimizer=torch.optim.AdamW(module.parameters()))
    meta = CheckpointMeta(
        step=step,
        data_state={},
        driver_rng={},
        plan={"groups": []},
        config_hash="c",
        model_hash="m",
        modules={n: ModuleRecord(1, False, True) for n in family.module_names},
    )
    return commit_checkpoint(tmp, meta=meta, keep_last=1)


def stored(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the HF directory ``path`` as its safetensors store it (the shards its index
    lists, or one ``model.safetensors``)."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    weight_map = json.loads(index.read_text())["weight_map"]
    out = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(str(path / file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is no dict)
    assert set(out) == set(weight_map), "the index and the shards disagree"
    return out


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and the same bytes (a NaN equals itself here, unlike ``torch.equal``)."""
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return a.shape == b.shape and torch.equal(*flat)


def assert_rebuilt(src: Path, out: Path, *, carried: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``out`` has exactly ``src``'s keys, more than one shard, ``src``'s config.json, and every
    tensor under a ``carried`` prefix byte-equal to the source's (same dtype, shape, values). Returns
    ``out``'s tensors."""
    want, got = stored(src), stored(out)
    assert set(got) == set(want), (sorted(set(want) - set(got))[:5], sorted(set(got) - set(want))[:5])
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    kept = [k for k in want if k.startswith(carried)]
    assert kept and all(k.startswith(("thinker.", *carried)) for k in want)
    differ = [k for k in kept if got[k].dtype != want[k].dtype or not bit_equal(got[k], want[k])]
    assert not differ, differ[:5]
    return got
