"""Activation-checkpointing modes: the one parser every layer uses (config, plan, parallel).

``modules.<m>.activation_checkpointing`` is a string:

- ``off``: every layer keeps its saved activations for backward.
- ``full``: every block keeps only its input; its activations are recomputed in backward.
- ``selective``: op-level: matmul outputs are kept, the cheap ops between them are recomputed.
- ``every_n:K``: only every K-th block is checkpointed (K=1 is ``full``).

YAML booleans from older recipes are accepted: ``true`` means ``full``, ``false`` means ``off``
(OmegaConf turns a bool given to a string field into ``"True"``/``"False"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AC_MODES = ("off", "full", "selective", "every_n:K")


@dataclass(frozen=True)
class AcMode:
    """A parsed mode. ``every_n`` is the checkpoint stride for ``full`` (1) and ``every_n`` (K)."""

    kind: str  # off | full | selective | every_n
    every_n: int = 1

    @property
    def enabled(self) -> bool:
        return self.kind != "off"

    def __str__(self) -> str:
        return f"every_n:{self.every_n}" if self.kind == "every_n" else self.kind


def parse_ac_mode(value: Any) -> AcMode:
    """``value`` (str or bool) -> AcMode; ValueError with the accepted spellings otherwise."""
    text = str(value).strip().lower()
    if text in ("off", "false", "none"):
        return AcMode("off")
    if text in ("full", "true"):
        return AcMode("full")
    if text == "selective":
        return AcMode("selective")
    if text.startswith("every_n:"):
        k = text.split(":", 1)[1].strip()
        if k.isdigit() and int(k) >= 1:
            return AcMode("full") if int(k) == 1 else AcMode("every_n", int(k))
    raise ValueError(f"{value!r} is not an activation-checkpointing mode; use one of {', '.join(AC_MODES)}")
