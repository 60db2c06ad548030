"""The run's module graph by role, from the family's declaration (``FamilyArch.module_names``,
producers first, the consumer that computes the loss last): which of a run's ``modules`` is the
consumer, which are producers, and which producer encodes images. The generic layers ask these
instead of naming a module; pure (no torch), so validation and the data layer can use it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from dhp.models.registry import family_names, get_arch


def run_module_names(family: str, present: Collection[str]) -> list[str]:
    """The family's modules a run has (``present``: the keys of its ``modules``), producers first."""
    return [n for n in get_arch(family).module_names if n in present]


def consumer_name(family: str) -> str:
    """The family's loss module: its last declared module."""
    return get_arch(family).module_names[-1]


def producer_names(family: str, present: Collection[str]) -> list[str]:
    """The producers a run has, in declared order (every module but the consumer)."""
    consumer = consumer_name(family)
    return [n for n in run_module_names(family, present) if n != consumer]


def image_module(family: str) -> str:
    """The producer that encodes images and videos (patches in, the ``image_embeds`` hand-off out):
    the family's ``image_module`` when its arch declares one, else its last declared producer (the
    one next to the consumer: ``(encoder, consumer)`` and ``(audio encoder, image encoder, consumer)``)."""
    arch = get_arch(family)
    declared = getattr(arch, "image_module", None)  # optional: only families that place it elsewhere
    if declared:
        return str(declared)
    return arch.module_names[-2] if len(arch.module_names) > 1 else ""


def module_seq_lens(modules: Mapping[str, Any]) -> dict[str, int]:
    """Each module's ``seq_len`` (``modules``: the run's, name -> ModuleConfig): what the data layer
    bounds a producer's per-sample rows by when the producer reads no pixel rows (audio frames)."""
    return {str(n): int(m.seq_len) for n, m in modules.items()}


def seq_limits(family: str, modules: Mapping[str, Any]) -> tuple[int, int]:
    """(patches of one micro-batch of one consumer replica: the image encoder's ``seq_len``, 0 when
    the run has none; tokens of one sample: the consumer's ``seq_len``). ``modules``: the run's
    ``modules`` (name -> ModuleConfig)."""
    image = image_module(family)
    patches = int(modules[image].seq_len) if image in modules else 0
    return patches, int(modules[consumer_name(family)].seq_len)


def known_consumer(family: str) -> str | None:
    """:func:`consumer_name`, or None when ``family`` is not a known family (validation reports that)."""
    return consumer_name(family) if family in family_names() else None


def known_image_module(family: str) -> str | None:
    """:func:`image_module`, or None when ``family`` is not a known family (validation reports that)."""
    return image_module(family) if family in family_names() else None
