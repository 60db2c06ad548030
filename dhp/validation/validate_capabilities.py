"""A run may use only what its model family declares it does exactly (``Capabilities`` of the family's
typed architecture, ``dhp.models.arch``): packing and video are refused, not assumed, for a family
that does not declare them."""

from __future__ import annotations

from omegaconf import DictConfig

from dhp.config.issues import Issues
from dhp.models.registry import family_names, get_arch


def declaring(capability: str) -> list[str]:
    """The families that declare ``capability`` (for the fix of a refusal)."""
    return [f for f in family_names() if getattr(get_arch(f).capabilities, capability)]


def validate_capabilities(cfg: DictConfig, issues: Issues) -> None:
    """Refuse ``data.packing`` and synthetic videos when ``model.family`` does not declare them."""
    family = cfg.model.family
    if family not in family_names():
        return  # reported by the model checks
    caps = get_arch(family).capabilities
    if cfg.data.packing:
        issues.check(
            caps.packing,
            "data.packing",
            True,
            f"model family {family} does not declare packing: its LLM has no per-sample positions or "
            "masks for several samples in one row, so a packed loss would differ from the unpacked one",
            f"set data.packing=false, or use a family that declares packing ({', '.join(declaring('packing'))})",
        )
    if cfg.data.kind == "synthetic" and cfg.data.synthetic.videos_per_sample > 0:
        issues.check(
            caps.video,
            "data.synthetic.videos_per_sample",
            cfg.data.synthetic.videos_per_sample,
            f"model family {family} does not declare video: it has no video path proven against transformers",
            f"set data.synthetic.videos_per_sample=0, or use a family that declares video "
            f"({', '.join(declaring('video'))})",
        )
