"""Save and load one module group's state with torch.distributed.checkpoint (DCP).

Both functions run inside every rank of ONE module group, collectively over that group's default
process group (no process group at all is fine: a plain single process). Tensors are written
shard-by-shard as the ranks hold them (DTensor TP/FSDP shards, replicated tensors once), so no rank
ever materialises the full module; loading reshards to whatever placement the live model has
(TP=2 -> TP=1, 1 -> 2 ranks, ...). A per-rank ``extra`` dict (RNG, worker-side LR schedule) goes to
``<path>/extra/rank_<r>.pt``.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from dhp.errors import CheckpointError

MODULE_FILE = "dhp_module.json"
MODEL_KEY = "model"
OPTIM_KEY = "optim"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def single_process_quiet():
    """Silence DCP's warning for a deliberate single-process save/load (no process group)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def _rank_world() -> tuple[int, int]:
    if _distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The DCP state dict: ``{"model": ..., "optim": ...}`` keyed by FQN (sharded tensors stay sharded)."""
    if optimizer is None:
        msd, _ = get_state_dict(model, [])
        return {MODEL_KEY: msd}
    msd, osd = get_state_dict(model, optimizer)
    return {MODEL_KEY: msd, OPTIM_KEY: osd}


def save_module_state(
    path: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Collectively write ``model`` (+ ``optimizer`` unless None, e.g. a frozen module) to ``path``.

    Every rank of the group must call this with the same ``path``. Memory: no gathers; each rank
    writes its own shards. Returns after all ranks finished (DCP ends with a collective).
    """
    path = Path(path)
    rank, world = _rank_world()
    (path / "extra").mkdir(parents=True, exist_ok=True)
    torch.save(extra or {}, path / "extra" / f"rank_{rank}.pt")
    if rank == 0:
        info = {"world_size": world, "has_optimizer": optimizer is not None}
        (path / MODULE_FILE).write_text(json.dumps(info))
    with single_process_quiet():
        dcp.save(_state(model, optimizer), checkpoint_id=str(path), no_dist=not _distributed())


def _logical_shapes(flat: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    out = {}
    for k, v in flat.items():
        if isinstance(v, DTensor | torch.Tensor):
            out[k] = tuple(v.shape)  # DTensor.shape is the global shape
    return out


def _compare(path: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """Raise CheckpointError listing tensors missing from the checkpoint or with another global shape."""
    saved = {
        k: tuple(m.size)
        for k, m in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    missing = sorted(k for k in expected if k not in saved)
    shape = sorted(
        f"{k}: checkpoint {saved[k]} vs model {v}"
        for k, v in expected.items()
        if k in saved and saved[k] != v
    )
    if missing or shape:
        lines = [f"checkpoint {path} does not match this module:"]
        if missing:
            lines.append(f"  {len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[:5]}")
        if shape:
            lines.append(f"  {len(shape)} tensor(s) with another global shape, e.g. {shape[:5]}")
        lines.append("  Fix: resume with the same model architecture (model.* config) as the checkpoint.")
        raise CheckpointError("\n".join(lines))


def _group_params(state: dict[str, Any]) -> list[list[str]] | None:
    """This rank's parameter FQNs of each optimizer group, in group order (None without an optimizer)."""
    if OPTIM_KEY not in state:
        return None
    return [list(g["params"]) for g in state[OPTIM_KEY]["param_groups"]]


def _restore_group_params(state: dict[str, Any], live: list[list[str]] | None) -> None:
    """Give each loaded optimizer group this rank's parameter FQNs again, by group index.

    DCP stores a non-tensor value once, so every rank reads back ONE rank's ``param_groups``, whose
    ``params`` lists name that rank's parameters. Under ZeRO-1 each rank's groups hold different
    parameters (the same groups, in the same order, with the same settings on every rank), so a rank
    whose parameters that list does not name would get groups without their settings (lr, betas, ...)
    from ``set_state_dict``, and its first step would fail. The groups' settings come from the
    checkpoint; only the parameter lists are this rank's. A checkpoint with another number of groups
    is left as read (``set_state_dict`` reports it)."""
    if live is None:
        return
    groups = state[OPTIM_KEY]["param_groups"]
    if len(groups) != len(live):
        return
    for group, names in zip(groups, live, strict=True):
        group["params"] = names


def read_module_info(path: Path) -> dict[str, Any]:
    """``{"world_size", "has_optimizer"}`` of a saved module dir; CheckpointError when absent."""
    f = Path(path) / MODULE_FILE
    if not f.is_file():
        raise CheckpointError(f"{path} holds no dhp module checkpoint ({MODULE_FILE} missing).")
    return json.loads(f.read_text())


def load_module_state(
    path: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> dict[str, Any] | None:
    """Collectively load ``path`` into the live (possibly sharded) ``model`` and ``optimizer``.

    Checks first that every tensor the live state needs exists in the checkpoint with the same
    global shape (CheckpointError listing the differences otherwise), then reads only this rank's
    shards. Optimizer state is loaded only when ``optimizer`` is given; a checkpoint without it
    (saved frozen) cannot resume a trainable module. Returns this rank's ``extra`` if the group's
    world size is the one that saved it, else None (resharded resume).
    """

    path = Path(path)
    info = read_module_info(path)
    if optimizer is not None and not info["has_optimizer"]:
        raise CheckpointError(
            f"checkpoint {path} holds no optimizer state (the module was frozen when it was saved) "
            "but the module is trainable now. Fix: keep `freeze: true` for it, or start its optimizer "
            "fresh from a weights-only export."
        )
    state = _state(model, optimizer)
    flat, _ = flatten_state_dict(state)
    _compare(path, _logical_shapes(flat))
    live_groups = _group_params(state)
    with single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
    _restore_group_params(state, live_groups)
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state[MODEL_KEY], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=state[MODEL_KEY], optim_state_dict=state[OPTIM_KEY])
    rank, world = _rank_world()
    if world != info["world_size"]:
        return None
    return torch.load(path / "extra" / f"rank_{rank}.pt", weights_only=True)
