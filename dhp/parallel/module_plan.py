"""What ``dhp.parallel`` needs to know about one module of a model family, as data.

A family builds its modules and attaches a :class:`ModuleParallelPlan` to each
(``module.parallel_plan``); :func:`dhp.parallel.parallelize` reads it and applies TP, Ulysses SP,
AC and FSDP2 from outside. The types live here, in the layer that reads them, so ``dhp.parallel``
imports nothing from ``dhp.models`` (the families import these, and the TP styles, from here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AttentionSite:
    """Where attention sits in a module, for Ulysses SP applied from outside (``dhp.parallel.ulysses``).

    ``modules``: FQN glob of attention modules that attend over the whole sequence; ``qkv``: their child
    Linear whose output is ``(L, 3*H*d)`` laid out (3, H, d), or (``projections``) their three child
    Linears q, k, v, each with output ``(L, H*d)``; ``out``: the child Linear that takes ``(L, H*d)``;
    ``heads``: the head-count attribute (set to H/sp while sharded by heads).
    """

    modules: str
    qkv: str = "qkv"
    projections: tuple[str, ...] = ()  # separate q, k, v Linears (then ``qkv`` is not read)
    out: str = "proj"
    heads: str = "num_heads"


@dataclass(frozen=True)
class ModuleParallelPlan:
    """What ``dhp.parallel.parallelize`` needs to know about one module of a family (data only).

    ``blocks``: FQN globs of the repeated blocks (FSDP units). ``tp(sequence_parallel)``: ``{FQN glob:
    DTensor style}``, None: no TP. ``tp_divides``: ``{what: size}`` every tp degree must divide.
    ``tp_heads``: FQN globs of attention modules whose ``num_heads`` becomes H/tp. ``tp_sequence_parallel``:
    Megatron SP inside TP is supported. ``sp``: attention sites for Ulysses SP (empty: no Ulysses).
    ``sp_local``: SP by the input cut alone (the family's ``shard_inputs`` gives each SP rank whole
    attention windows, so every attention stays on its rank: nothing is exchanged; the SP ranks'
    gradients are summed like any SP module's). ``sp_divides``: sizes every sp degree must divide. ``loss``: the module has ``loss_fn`` (swapped for
    the chunked / vocab-parallel loss). ``tied``: ``{fqn: source_fqn}`` re-shared after TP.
    ``pad_token_id``: pads token inputs to a multiple of tp under sequence parallelism.
    ``moe_blocks``: FQN glob of the sparse-MoE blocks (each with an ``experts`` child in transformers'
    fused 3-D layout, see ``dhp.parallel.ep``), empty: none; ``experts``: their expert count (every
    ep degree must divide it; 0 = no MoE block, so ``ep`` must be 1).
    """

    blocks: tuple[str, ...]
    tp: Callable[[bool], Mapping[str, Any]] | None = None
    tp_divides: Mapping[str, int] = field(default_factory=dict)
    tp_heads: tuple[str, ...] = ()
    tp_sequence_parallel: bool = False
    sp: tuple[AttentionSite, ...] = ()
    sp_local: bool = False
    sp_divides: Mapping[str, int] = field(default_factory=dict)
    loss: bool = False
    tied: Mapping[str, str] = field(default_factory=dict)
    pad_token_id: int = 0
    moe_blocks: str = ""
    experts: int = 0
    cp: bool = False  # context parallelism (``dhp.parallel.cp``): the family's forward cuts its tokens
    cp_divides: Mapping[str, int] = field(default_factory=dict)
    cp_sequence_parallel: bool = True
    #: FQN glob of the Gated DeltaNet (linear attention) layers: under CP each gathers its sequence and
    #: cuts its heads (``dhp.parallel.linear_attn_cp``); empty: none
    linear_attention: str = ""
    #: pipeline parallelism (stages cut by decoder layers) is supported; ``pp_layers``: the decoder
    #: layers a cut divides
    pp: bool = False
    pp_layers: int = 0


__all__ = ["AttentionSite", "ModuleParallelPlan"]
