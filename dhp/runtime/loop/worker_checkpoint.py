"""A module rank's checkpoints: save (synchronous or staged to host memory and written in the
background) and load (resharding when the plan changed) of its model and optimizer state and RNG;
``dhp.checkpoint`` does the I/O, collectively over the group.

A mixin of :class:`dhp.runtime.loop.worker.ModuleWorker` (its attributes: ``module``, ``optimizer``,
``faults``). Memory: the async save's host copy of this rank's state until its write is done.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dhp.checkpoint import capture_rng_state, load_module_state, restore_rng_state, save_module_state
from dhp.checkpoint.async_state import async_save_status, save_module_state_async
from dhp.runtime.actors.dispatch import Collect, Dispatch, register


class CheckpointMethods:
    """Save and load one module rank's state (see the module docstring)."""

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def save_checkpoint(self, path: str) -> None:
        """Write this rank's model + optimizer state (and RNG) into ``path`` (DCP, collectively)."""
        self.faults.at("save")
        save_module_state(
            Path(path), model=self.module, optimizer=self.optimizer, extra={"rng": capture_rng_state()}
        )

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def save_checkpoint_async(self, path: str) -> float:
        """Stage this rank's state to host memory and write it in the background; returns the staging
        seconds (dhp.checkpoint.async_state; the write's status: ``checkpoint_write_status``)."""
        staging_s = save_module_state_async(
            Path(path), model=self.module, optimizer=self.optimizer, extra={"rng": capture_rng_state()}
        )
        self.faults.at("save_async")  # the write runs in the background now
        return staging_s

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def checkpoint_write_status(self, wait: bool) -> dict[str, Any] | None:
        """This rank's in-flight checkpoint write (None: none); ``wait`` blocks until it is written."""

        return async_save_status(wait=wait)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def load_checkpoint(self, path: str) -> bool:
        """Load model+optimizer (resharding if the plan changed); True if this rank's RNG was restored."""

        extra = load_module_state(Path(path), model=self.module, optimizer=self.optimizer)
        if extra is not None and "rng" in extra:
            restore_rng_state(extra["rng"])
            return True
        return False
