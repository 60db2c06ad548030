"""Peak memory of the calling rank, reset per log window.

cuda: ``torch.cuda.max_memory_allocated`` (bytes allocated by tensors; reset each window).
cpu: the process's peak resident set size, a proxy that includes Python, torch and the Ray worker.
On Linux it is ``VmHWM`` from ``/proc/self/status``, reset per window by writing ``5`` to
``/proc/self/clear_refs`` (the kernel then restarts the high-water mark from the current RSS).
Where that is unavailable (macOS, a locked-down /proc) it falls back to ``getrusage``'s
``ru_maxrss``, which cannot be reset: the peak since the process started.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes of this process on ``device`` since the last :func:`reset_peak_memory`."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _vm_hwm_bytes()
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak window; False where the OS cannot reset it (cpu without /proc)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def _vm_hwm_bytes() -> int | None:
    """The process's resident-set high-water mark (Linux ``VmHWM``), or None without /proc."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None
