"""Checkpoints: DCP per module group, atomic commit, keep-last-K, resume discovery, HF export.

Driver side: :func:`begin_checkpoint`, :func:`commit_checkpoint`, :func:`resolve_resume`,
:func:`check_resume_compatible`, :class:`CheckpointMeta`. Worker side (collective inside one
group): :func:`save_module_state`, :func:`load_module_state`. See docs/INTERFACES.md.
:func:`export_hf` is imported on first use: it loads the families' transformers model code, which
the driver's path to Ray's start does without (dhp.runtime.launch.startup).
"""

import importlib
from typing import Any

from dhp.checkpoint.compat import check_resume_compatible, model_arch_hash, module_records
from dhp.checkpoint.layout import (
    begin_checkpoint,
    checkpoint_candidates,
    commit_checkpoint,
    find_latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    remove_own_temps,
    remove_stale_temps,
    resolve_resume,
    step_dir_name,
)
from dhp.checkpoint.manifest import verify_checkpoint, write_manifest
from dhp.checkpoint.meta import CheckpointMeta, ModuleRecord, read_meta, stable_hash, write_meta
from dhp.checkpoint.module_state import load_module_state, read_module_info, save_module_state
from dhp.checkpoint.rng import capture_rng_state, restore_rng_state

__all__ = [
    "CheckpointMeta",
    "ModuleRecord",
    "begin_checkpoint",
    "capture_rng_state",
    "check_resume_compatible",
    "checkpoint_candidates",
    "commit_checkpoint",
    "export_hf",
    "find_latest_checkpoint",
    "list_checkpoints",
    "load_module_state",
    "model_arch_hash",
    "module_records",
    "prune_checkpoints",
    "read_meta",
    "read_module_info",
    "remove_own_temps",
    "remove_stale_temps",
    "resolve_resume",
    "restore_rng_state",
    "save_module_state",
    "stable_hash",
    "step_dir_name",
    "verify_checkpoint",
    "write_manifest",
    "write_meta",
]


def __getattr__(name: str) -> Any:
    if name != "export_hf":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module("dhp.checkpoint.export").export_hf
