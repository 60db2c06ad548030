"""A module's parallel axes, declared once: the runtime plan's checks are the declaration's.

A family declares each module's axes in its torch-free ``arch.py`` (``module_axes`` ->
:class:`~dhp.models.arch.ModuleAxes`: which axes exist, the sizes each degree must divide, by their
config key, and the expert count EP must divide). Validation and the ``--auto`` search read that;
:func:`runtime_plan` copies the same facts into the :class:`ModuleParallelPlan` the family attaches to
the module it builds, which ``dhp.parallel.parallelize`` reads. The family adds only what the runtime
needs beyond the axes: the FQN globs of its blocks, TP styles, attention sites, loss and ties.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dhp.config.plan_space import ModuleAxes
from dhp.parallel.module_plan import AttentionSite, ModuleParallelPlan


def runtime_plan(
    axes: ModuleAxes,
    *,
    blocks: tuple[str, ...],
    tp: Callable[[bool], Mapping[str, Any]] | None = None,
    tp_heads: tuple[str, ...] = (),
    sp: tuple[AttentionSite, ...] = (),
    loss: bool = False,
    tied: Mapping[str, str] | None = None,
    pad_token_id: int | None = 0,
    moe_blocks: str = "",
    linear_attention: str = "",
) -> ModuleParallelPlan:
    """The module's :class:`ModuleParallelPlan` with every divisibility fact from ``axes``.

    ``tp`` (the TP styles by FQN glob, a function of Megatron sequence parallelism) is kept only where
    ``axes.tp``, ``sp`` (the Ulysses attention sites) only where ``axes.sp``; ``moe_blocks`` (the FQN
    glob of the sparse blocks) gets ``axes.experts`` as the expert count every ep degree must divide.
    ``pad_token_id`` None (a config without one) pads with id 0. ``pp``/``pp_layers``: pipeline
    stages exist, cut over that many decoder layers (the declaration's).
    """
    return ModuleParallelPlan(
        blocks=blocks,
        tp=tp if axes.tp else None,
        tp_divides=dict(axes.tp_divides),
        tp_heads=tp_heads,
        tp_sequence_parallel=axes.tp_sequence_parallel,
        sp=sp if axes.sp else (),
        sp_local=axes.sp and not sp,  # SP with no attention site: the input cut alone
        sp_divides=dict(axes.sp_divides),
        loss=loss,
        tied=dict(tied or {}),
        pad_token_id=pad_token_id if pad_token_id is not None else 0,
        moe_blocks=moe_blocks if axes.experts else "",
        experts=axes.experts if moe_blocks else 0,
        cp=axes.cp,
        cp_divides=dict(axes.cp_divides),
        cp_sequence_parallel=axes.cp_sequence_parallel,
        linear_attention=linear_attention,
        pp=axes.pp,
        pp_layers=axes.pp_layers,
    )
