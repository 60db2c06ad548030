"""LoRA in an export: merge the adapters into the HF weights, or write peft's adapter format beside them.

A checkpoint of a module with peft LoRA layers holds, per adapted layer ``X``, ``X.base_layer.weight``
(the frozen base, saved under the base's HF key), ``X.lora_A.default.weight`` (r x in) and
``X.lora_B.default.weight`` (out x r). ``export.lora``:

- ``merge``: ``W = W_base + (alpha / r) * B @ A`` (Conv: over the flattened kernel), written under the
  HF key; the directory is a plain transformers model;
- ``adapter``: the HF directory holds the base weights; ``<out>/adapter/`` holds peft's
  ``adapter_config.json`` (``base_model_name_or_path`` = ``<out>``) and ``adapter_model.safetensors``
  (keys ``base_model.model.<HF layer>.lora_A.weight``): ``PeftModel.from_pretrained(base, out/adapter)``
  loads it, and so does ``from_pretrained(out/adapter)`` of transformers with peft installed.

Memory: one layer's A, B and W at a time in fp32, on top of the export's shard batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from dhp.checkpoint.module_state import MODEL_KEY, single_process_quiet
from dhp.errors import CheckpointError

LORA_MODES = ("merge", "adapter")
ADAPTER_DIR = "adapter"  # the peft adapter's folder inside an ``adapter`` export
_A, _B = ".lora_A.default.weight", ".lora_B.default.weight"


def is_adapter(fqn: str) -> bool:
    """True for a LoRA adapter tensor of a checkpoint (``X.lora_A.default.weight``...)."""
    return ".lora_A." in fqn or ".lora_B." in fqn


def base_fqn(fqn: str) -> str:
    """A wrapped layer's base tensor under its plain module FQN (``X.base_layer.weight`` -> ``X.weight``)."""
    return fqn.replace(".base_layer.", ".")


def adapted_layers(saved: dict[str, Any]) -> list[str]:
    """Module FQNs of the LoRA-adapted layers in one module's saved tensors."""
    return sorted(f[: -len(_A)] for f in saved if f.endswith(_A))


def check_mode(mode: str) -> None:
    if mode not in LORA_MODES:
        raise CheckpointError(
            f"export.lora={mode!r}: must be one of {LORA_MODES}. Fix: merge (default) or adapter."
        )


def _read_full(module_dir: Path, fqns: list[str], saved: dict[str, Any]) -> dict[str, torch.Tensor]:
    sd = {f"{MODEL_KEY}.{f}": torch.empty(saved[f].size, dtype=saved[f].properties.dtype) for f in fqns}
    with single_process_quiet():
        dcp.load(sd, checkpoint_id=str(module_dir), no_dist=True)
    return {f: sd[f"{MODEL_KEY}.{f}"] for f in fqns}


def lora_deltas(
    module_dir: Path, saved: dict[str, Any], *, alpha: float
) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{layer FQN: (A, B, scaling)}`` of one module's checkpoint (full fp32 tensors)."""
    out = {}
    for layer in adapted_layers(saved):
        t = _read_full(module_dir, [layer + _A, layer + _B], saved)
        a, b = t[layer + _A].float(), t[layer + _B].float()
        out[layer] = (a, b, float(alpha) / a.shape[0])
    return out


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + scaling * B @ A`` in fp32, cast back to W's dtype (Conv: flattened kernels)."""
    delta = (b.flatten(1) @ a.flatten(1)).reshape(weight.shape) * scaling
    return (weight.float() + delta).to(weight.dtype)


def write_adapter(
    out_dir: Path,
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor, int, float]],
    *,
    base_path: str | None,
    dtype: torch.dtype | None,
) -> None:
    """peft's adapter files for ``adapters`` (HF layer FQN -> (A, B, rank, alpha))."""
    from peft import LoraConfig  # peft adds ~2 s of import: loaded only when LoRA is used

    tensors, ranks, alphas = {}, {}, {}
    for hf, (a, b, rank, alpha) in adapters.items():
        tensors[f"base_model.model.{hf}.lora_A.weight"] = a if dtype is None else a.to(dtype)
        tensors[f"base_model.model.{hf}.lora_B.weight"] = b if dtype is None else b.to(dtype)
        ranks[hf], alphas[hf] = rank, alpha
    r, alpha = max(ranks.values()), max(alphas.values())
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=sorted(ranks),
        # peft matches pattern keys as regexes on the module name: anchor the exact layer
        rank_pattern={f"^{k}$": v for k, v in ranks.items() if v != r},
        alpha_pattern={f"^{k}$": v for k, v in alphas.items() if v != alpha},
        bias="none",
        base_model_name_or_path=base_path,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "adapter_model.safetensors"))
