"""Peak memory of the calling rank, reset per log window where the device allows.

cuda: ``torch.cuda.max_memory_allocated`` (bytes allocated by tensors; reset each window).
cpu: the process's peak resident set size (``getrusage`` ``ru_maxrss``), a proxy that includes
Python, torch and the Ray worker; the OS cannot reset it, so on CPU it is the peak since start.
"""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes of this process on ``device`` since the last reset (cpu: since start, RSS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak window (cuda only; cpu RSS peaks cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
