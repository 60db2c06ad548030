"""``meta.json``: the driver-side record of a checkpoint (step, data position, RNG, plan, hashes).

Written last into a checkpoint directory; its presence marks the checkpoint complete. Pure JSON,
no tensors, no device memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from dhp.errors import CheckpointError

META_FILE = "meta.json"
FORMAT_VERSION = 1


@dataclass
class ModuleRecord:
    """What one module group saved: its world size, whether it was frozen, whether it holds optimizer state."""

    world_size: int
    frozen: bool
    has_optimizer: bool


@dataclass
class CheckpointMeta:
    """Everything besides the DCP shards that a resume needs (see docs/INTERFACES.md, Checkpoint)."""

    step: int
    data_state: dict[str, Any]
    driver_rng: dict[str, Any]
    plan: dict[str, Any]
    config_hash: str
    model_hash: str
    modules: dict[str, ModuleRecord]
    scheduler_state: dict[str, Any] | None = None
    dhp_version: str = ""
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)


def _dhp_version() -> str:
    try:
        return version("dhp")
    except PackageNotFoundError:
        return "unknown"


def stable_hash(obj: Any) -> str:
    """A short sha256 of ``obj`` as sorted JSON (dicts, lists, scalars, dataclasses, OmegaConf configs)."""

    def plain(o: Any) -> Any:
        if isinstance(o, DictConfig | ListConfig):
            return OmegaConf.to_container(o, resolve=True)
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return dataclasses.asdict(o)
        if isinstance(o, dict):
            return {k: plain(v) for k, v in o.items()}
        if isinstance(o, list | tuple):
            return [plain(v) for v in o]
        return o

    blob = json.dumps(plain(obj), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def write_meta(ckpt_dir: Path, meta: CheckpointMeta) -> Path:
    """Write ``meta.json`` durably (temp file, fsync, rename) into ``ckpt_dir``; returns its path."""
    if not meta.dhp_version:
        meta = dataclasses.replace(meta, dhp_version=_dhp_version())
    path = Path(ckpt_dir) / META_FILE
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(dataclasses.asdict(meta), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_meta(ckpt_dir: Path) -> CheckpointMeta:
    """Read ``<ckpt_dir>/meta.json``; CheckpointError when missing, unreadable or of another format."""
    path = Path(ckpt_dir) / META_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt_dir} is not a complete checkpoint: {META_FILE} is missing (an interrupted save?). "
            "Fix: pass a complete step_XXXXXX directory, or resume=auto to pick the newest complete one."
        )
    try:
        raw = json.loads(path.read_text())
        if raw["format_version"] != FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: format_version {raw['format_version']} is not supported by this dhp "
                f"(expects {FORMAT_VERSION}). Fix: resume with the dhp version that wrote it."
            )
        raw["modules"] = {k: ModuleRecord(**v) for k, v in raw["modules"].items()}
        return CheckpointMeta(**raw)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{path} is corrupt or of an unknown layout ({e}). Fix: use another checkpoint."
        ) from e
