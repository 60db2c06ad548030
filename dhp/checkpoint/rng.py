"""Capture and restore random-number-generator state as JSON-able data.

Covers Python's ``random``, NumPy's global generator, torch's CPU generator and, when an
accelerator is present, its per-device generators. Nothing is placed on a device: accelerator
states are read and written as CPU byte tensors.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

from dhp.errors import CheckpointError


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def _accelerator_module() -> Any | None:
    """The torch device module (e.g. ``torch.cuda``) of the current accelerator, or None on CPU."""
    if not torch.accelerator.is_available():
        return None
    acc = torch.accelerator.current_accelerator()
    return None if acc is None else torch.get_device_module(acc)


def capture_rng_state() -> dict[str, Any]:
    """Return this process's RNG states as a JSON-able dict (no device memory is touched)."""
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()
    out: dict[str, Any] = {
        "python": [version, list(state), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch_cpu": _b64(torch.get_rng_state()),
        "accelerator": None,
    }
    mod = _accelerator_module()
    if mod is not None:
        out["accelerator"] = [_b64(s) for s in mod.get_rng_state_all()]
    return out


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore states written by :func:`capture_rng_state`.

    Raises CheckpointError when the checkpoint holds accelerator states for a different number of
    devices than this process sees (the run would not be reproducible).
    """
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    saved = state["accelerator"]
    mod = _accelerator_module()
    if saved is None:
        return
    if mod is None or mod.device_count() != len(saved):
        have = 0 if mod is None else mod.device_count()
        raise CheckpointError(
            f"RNG state was saved with {len(saved)} accelerator device(s) visible but this process sees "
            f"{have}. Fix: resume on the same device layout, or resume under a different plan "
            "(RNG is then not restored)."
        )
    mod.set_rng_state_all([_unb64(s) for s in saved])
