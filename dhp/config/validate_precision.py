"""Validation of ``modules.<name>.mixed_precision``: a precision that cannot take effect is refused.

What each policy stores and computes in is ``dhp/parallel/precision.py``'s table; ``model.dtype`` only
says what the weights come in (``float32`` or ``bfloat16``, both cast to the policy's parameter dtype
when loaded, checked with the model). Refused here, before anything starts:

- ``bf16_master_fp32`` on a frozen module (``freeze: true``): it keeps no gradients and no AdamW
  states, so there are no master weights to keep; the policy would only hold the weights in fp32
  to cast them to bf16 for every forward (twice the memory of ``bf16`` for the same compute);
- ``fp32`` with ``model.attn_implementation=flash_attention_2``: FlashAttention-2 computes in
  bf16/fp16 only, an fp32 module's attention inputs stay fp32 and the kernel refuses them.

Checked where it is known: whether a GPU computes bf16 (compute capability 8.0 or newer) is checked by
each rank on its own device as it builds (``dhp.runtime.loop.worker``: a ConfigError naming the same
key); CPU torch computes bf16 on every machine.
"""

from __future__ import annotations

from omegaconf import DictConfig

from dhp.config.constants import MIXED_PRECISIONS
from dhp.config.issues import Issues


def validate_precision(cfg: DictConfig, issues: Issues) -> None:
    """Add a ConfigIssue for every module whose ``mixed_precision`` cannot take effect (module docstring)."""
    for name, mod in cfg.modules.items():
        path, policy = f"modules.{name}.mixed_precision", mod.mixed_precision
        if policy not in MIXED_PRECISIONS:
            continue  # reported by the plan-validity rule (dhp.config.plan_space)
        issues.check(
            not (mod.freeze and policy == "bf16_master_fp32"),
            path,
            policy,
            "a frozen module (freeze: true) keeps no gradients or AdamW states, so it has no master "
            "weights: bf16_master_fp32 would only store its weights in fp32 to cast them to bf16 for every "
            "forward",
            f"set {path}=bf16 (bf16 weights and compute: what bf16_master_fp32 computes, at half the "
            "memory) or fp32",
        )
        issues.check(
            not (policy == "fp32" and cfg.model.attn_implementation == "flash_attention_2"),
            path,
            policy,
            "model.attn_implementation=flash_attention_2 computes in bf16/fp16 only; an fp32 module hands "
            "it fp32 inputs",
            f"set {path}=bf16_master_fp32 (bf16 compute, fp32 master weights) or "
            "model.attn_implementation=sdpa",
        )
