"""LoRA adapters through peft on any module, and how their A/B matrices follow the base layer's TP style.

:func:`apply_lora` injects peft's own LoRA layers (``peft.inject_adapter_in_model``) into the
single-device module, before any parallelism, at the submodules the ``modules.<m>.lora.targets``
globs match (module FQNs, one atom per ``*``). peft wraps each target ``X`` into ``X.base_layer`` (the
original layer, frozen) plus ``X.lora_A.default`` (r x in) and ``X.lora_B.default`` (out x r), and
adds ``B(A(dropout(x))) * alpha / r`` to the base output; B starts at zero.

Tensor parallelism (:func:`lora_tp_plan`, applied to the module's TP plan before ``parallelize_module``):
a plan entry that matches a wrapped layer moves to ``X.base_layer`` and gains the adapter entries, so
A/B are sharded consistently with the base (the convention peft uses for transformers' own TP):

- column-parallel base (``Shard(0)`` of W, incl. a fused q|k|v column style): A replicated (a plain
  parameter, its input is the replicated layer input), B gets the base's style (``Shard(0)``, the
  same output layout, a fused style's row moves); B's input gradient is all-reduced by that style;
- row-parallel base (``Shard(1)`` of W): A gets the base's style (``Shard(1)``: it reads this rank's
  input features, its output is all-reduced, or reduce-scattered into sequence shards under
  sequence parallelism), B replicated (plain; a ``Replicate`` DTensor when the base's output stays a
  DTensor, whose ``Partial`` weight gradient ``finalize_grads`` reduces).

Memory per rank: A and B of a colwise target cost ``r*in + r*out/N`` elements, of a rowwise one
``r*in/N + r*out``; their grads and AdamW states the same. SP (Ulysses), FSDP2 and ZeRO-1 see the
adapters as ordinary trainable parameters (the base layers are frozen: no grads, no optimizer state).
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from dhp.errors import ConfigError, ConfigIssue

ADAPTER = "default"  # peft's adapter name; FQNs read ``X.lora_A.default.weight``
#: layer types peft's LoRA wraps here (Linear and Conv; an Embedding is refused: its vocab-parallel
#: TP style has no adapter rule)
SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _exact(fqn: str, glob: str) -> bool:
    a, b = fqn.split("."), glob.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b, strict=True))


def lora_targets(module: nn.Module, *, module_name: str, lora: Any) -> list[str]:
    """The module FQNs the ``lora.targets`` globs match; ConfigError for bad values or a glob that
    matches nothing LoRA can adapt (all problems at once)."""
    key = f"modules.{module_name}.lora"
    issues: list[ConfigIssue] = []
    if lora.rank < 0:
        issues.append(ConfigIssue(f"{key}.rank", lora.rank, "must be >= 0 (0 = off)", "e.g. 8"))
    if lora.rank == 0:
        if lora.targets:
            issues.append(
                ConfigIssue(f"{key}.rank", 0, "targets are set but rank 0 turns LoRA off", "set rank, e.g. 8")
            )
        if issues:
            raise ConfigError(issues)
        return []
    if not lora.alpha > 0:
        issues.append(
            ConfigIssue(f"{key}.alpha", lora.alpha, "must be > 0 (scaling = alpha / rank)", "e.g. 16")
        )
    if not 0.0 <= lora.dropout < 1.0:
        issues.append(ConfigIssue(f"{key}.dropout", lora.dropout, "must be in [0, 1)", "e.g. 0.05, or 0"))
    if not lora.targets:
        issues.append(
            ConfigIssue(
                f"{key}.targets", [], "LoRA needs at least one target glob", "e.g. ['*.*.*.self_attn.q_proj']"
            )
        )
    head = getattr(module, "lm_head", None)  # the LLM contract: the loss reads lm_head.weight directly
    found: list[str] = []
    for i, glob in enumerate(lora.targets):
        hits = [(f, m) for f, m in module.named_modules() if f and _exact(f, glob)]
        experts = [f for f, m in hits if _fused_experts(m)]
        if experts:
            issues.append(ConfigIssue(f"{key}.targets[{i}]", glob, f"matches mixture-of-experts experts "
                                      f"{experts[:2]}: LoRA on experts is not supported (their weights are "
                                      "fused 3-D tensors, sharded by expert parallelism, not Linear layers)",
                                      "target the attention projections (e.g. '*.*.*.self_attn.q_proj') only"))  # fmt: skip
            continue
        ok = [f for f, m in hits if isinstance(m, SUPPORTED)]
        if not ok:
            kinds = sorted({type(m).__name__ for _, m in hits}) or ["nothing"]
            sample = sorted(f for f, m in module.named_modules() if isinstance(m, SUPPORTED))[:4]
            issues.append(ConfigIssue(f"{key}.targets[{i}]", glob, f"matches no Linear/Conv submodule (matched: "
                                      f"{kinds}; '*' = one FQN atom)", f"use FQNs such as {sample}"))  # fmt: skip
        for _, m in hits:
            if head is not None and m is head:
                issues.append(ConfigIssue(f"{key}.targets[{i}]", glob, "matches lm_head, whose weight the chunked "
                                          "loss reads directly (an adapter there would never run)", "drop lm_head"))  # fmt: skip
        found += [f for f in ok if f not in found]
    if issues:
        raise ConfigError(issues)
    return found


def _fused_experts(m: nn.Module) -> bool:
    """A transformers fused-experts module (3-D ``gate_up_proj``/``down_proj``), EP-swapped or not."""
    return any(
        getattr(m, n, None) is not None and getattr(m, n).dim() == 3 for n in ("gate_up_proj", "down_proj")
    )


def lora_config(lora: Any, targets: list[str]):
    """peft's ``LoraConfig`` for exact FQN targets (peft matches a list entry by FQN equality)."""
    from peft import LoraConfig  # peft adds ~2 s of import: loaded only when LoRA is used

    return LoraConfig(
        r=int(lora.rank),
        lora_alpha=float(lora.alpha),
        lora_dropout=float(lora.dropout),
        target_modules=list(targets),
        bias="none",
    )


def apply_lora(module: nn.Module, *, module_name: str, lora: Any) -> nn.Module:
    """Inject peft LoRA layers into ``module`` in place (a no-op for ``lora.rank == 0``) and return it.

    Call on the single-device module, before ``parallelize``. On a real device A is initialised from
    the global torch RNG (every rank seeded alike gets the same A) and B is zero; on ``meta`` the
    adapters are empty until :func:`init_lora_params` after the weights are loaded. Every non-adapter
    parameter of the module is frozen by peft (``dhp.parallel.param_groups.apply_trainable`` agrees).
    """
    targets = lora_targets(module, module_name=module_name, lora=lora)
    if not targets:
        return module
    from peft import inject_adapter_in_model  # peft adds ~2 s of import: loaded only when LoRA is used

    return inject_adapter_in_model(lora_config(lora, targets), module, adapter_name=ADAPTER)


def named_sizes_with_lora(module: nn.Module, *, module_name: str, lora: Any) -> dict[str, int]:
    """``{parameter FQN: elements}`` of ``module`` as :func:`apply_lora` would leave it, computed without
    building the adapters (fast on a meta module of any size): a wrapped layer's own parameters move
    under ``X.base_layer``, and ``X.lora_A.default.weight`` (r x in) / ``X.lora_B.default.weight``
    (out x r) are added. Raises ConfigError like :func:`apply_lora` for bad targets or values."""
    targets = set(lora_targets(module, module_name=module_name, lora=lora))
    r = int(lora.rank)
    out: dict[str, int] = {}
    for n, p in module.named_parameters():
        layer, leaf = n.rsplit(".", 1)
        out[f"{layer}.base_layer.{leaf}" if layer in targets else n] = p.numel()
    for t in sorted(targets):
        m = module.get_submodule(t)
        if isinstance(m, nn.Linear):
            fan_in, fan_out = m.in_features, m.out_features
        else:  # Conv: A has the base's kernel, B is 1x1
            fan_in, fan_out = m.in_channels // m.groups * math.prod(m.kernel_size), m.out_channels
        out[f"{t}.lora_A.{ADAPTER}.weight"] = r * fan_in
        out[f"{t}.lora_B.{ADAPTER}.weight"] = fan_out * r
    return out


class ReplicateParallel(ParallelStyle):
    """Every parameter of the module becomes a ``Replicate`` DTensor; inputs/outputs untouched.

    For a row-parallel base's B when the base's output stays a DTensor (sequence parallelism): the
    DTensor input (``Shard(1)``) and weight meet in one DTensor op; the weight grad comes out
    ``Partial`` over the sequence shards and ``finalize_grads`` reduces it.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for n, p in list(mod.named_parameters(recurse=False)):
                dp = nn.Parameter(distribute_tensor(p, mesh, [Replicate()]), requires_grad=p.requires_grad)
                mod.register_parameter(n, dp)

        return distribute_module(module, device_mesh, replicate)


def _adapter_styles(fqn: str, style: ParallelStyle) -> dict[str, ParallelStyle]:
    base, a, b = f"{fqn}.base_layer", f"{fqn}.lora_A.{ADAPTER}", f"{fqn}.lora_B.{ADAPTER}"
    if isinstance(style, ColwiseParallel):
        return {base: style, b: copy.copy(style)}
    if isinstance(style, RowwiseParallel):
        out = {base: style, a: copy.copy(style)}
        if not style.use_local_output:
            out[b] = ReplicateParallel()
        return out
    raise ConfigError(
        [ConfigIssue("lora.targets", fqn, f"its TP style {type(style).__name__} has no LoRA sharding rule "
                     "(column- and row-parallel Linears have)", "drop it from lora.targets or set this module's tp=1")]
    )  # fmt: skip


def lora_tp_plan(module: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` with every entry that matches a peft-wrapped layer split into base + adapter entries.

    Entries that match no wrapped layer stay as they are (the same dict when the module has no LoRA).
    """
    from peft.tuners.lora import LoraLayer  # peft adds ~2 s of import: loaded only when LoRA is used

    wrapped = {f for f, m in module.named_modules() if isinstance(m, LoraLayer)}
    if not wrapped:
        return dict(plan)
    names = [f for f, _ in module.named_modules() if f]
    out: dict[str, ParallelStyle] = {}
    for glob, style in plan.items():
        hits = [f for f in names if _exact(f, glob)]
        if not any(f in wrapped for f in hits):
            out[glob] = style
            continue
        for f in hits:
            out.update(_adapter_styles(f, style) if f in wrapped else {f: style})
    return out


def lora_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The (FQN, parameter) pairs of the LoRA adapters in ``module``."""
    return [(n, p) for n, p in module.named_parameters() if ".lora_A." in n or ".lora_B." in n]


@torch.no_grad()
def init_lora_params(module: nn.Module, *, seed: int) -> None:
    """Initialise materialised adapters (after a meta build and a weight load) plan-independently.

    Each A is drawn in full on the CPU from a generator seeded by ``seed`` and its FQN (kaiming-uniform
    as ``nn.Linear``, like peft's default), B is zero; a DTensor (TP/FSDP shard) keeps only its slice.
    """
    for name, p in lora_params(module):
        full = torch.zeros(p.shape, dtype=torch.float32)
        if ".lora_A." in name:
            g = torch.Generator().manual_seed(seed + int(hashlib.sha1(name.encode()).hexdigest()[:8], 16))
            bound = (
                1.0 / max(full[0].numel(), 1) ** 0.5
            )  # kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(fan_in), ..)
            full.uniform_(-bound, bound, generator=g)
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            full = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
            p.to_local().copy_(full.to(p.dtype))
        else:
            p.copy_(full.to(p.dtype))


def inject_reference_lora(
    model: nn.Module, owner: dict[str, tuple[str, str]], *, modules: Mapping[str, Any]
) -> None:
    """The same LoRA on the unsplit reference model, by HF FQN; extends ``owner`` (HF key -> (module,
    module FQN)) to the wrapped layers' ``base_layer`` keys and the adapters' keys."""
    by_fqn = {mf: key for key, mf in owner.items()}
    hf_targets: dict[str, tuple[str, str]] = {}  # HF layer path -> (module, module layer path)
    from peft import inject_adapter_in_model  # peft adds ~2 s of import: loaded only when LoRA is used

    for m, cfg in modules.items():
        if cfg.lora.rank <= 0:
            continue
        layers = sorted({n.rsplit(".", 1)[0] for mm, n in owner.values() if mm == m})
        mine = {}
        for path in layers:
            if any(_exact(path, g) for g in cfg.lora.targets) and (m, path + ".weight") in by_fqn:
                mine[by_fqn[(m, path + ".weight")].rsplit(".", 1)[0]] = (m, path)
        if mine:
            with warnings.catch_warnings():  # a second module's layers join the same "default" adapter
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                inject_adapter_in_model(lora_config(cfg.lora, sorted(mine)), model, adapter_name=ADAPTER)
            hf_targets.update(mine)
    if not hf_targets:
        return
    for key, _ in model.named_parameters(remove_duplicate=False):
        if key in owner:
            continue
        layer = max((t for t in hf_targets if key.startswith(t + ".")), key=len)
        m, path = hf_targets[layer]
        owner[key] = (m, f"{path}.{key[len(layer) + 1 :]}")
    for layer in hf_targets:
        for leaf in ("weight", "bias"):
            owner.pop(f"{layer}.{leaf}", None)
