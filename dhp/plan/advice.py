"""What to change when a plan does not fit: the biggest consumer of memory on the fullest GPU, and
the knobs that shrink it (for activations, by the module's place in the graph). Pure; used by
``dhp plan`` output."""

from __future__ import annotations

from dhp.plan.types import Plan

_KNOBS = {
    "optimizer": "shard it: parallel.zero=1 with dp*sp > 1, parallel.fsdp, a larger tp, or mixed_precision=bf16",
    "params": "shard them: a larger parallel.tp or parallel.fsdp",
    "grads": "shard them: a larger parallel.tp or parallel.fsdp",
}


def _activation_knob(plan: Plan, name: str) -> str:
    """The knobs that shrink module ``name``'s activations: the loss module (the one whose loss
    chunk the plan resolved) by its checkpointing and rows; a producer also by Ulysses SP."""
    if name in plan.loss_chunk_tokens:
        return (
            f"set modules.{name}.activation_checkpointing=full, or lower modules.{name}.seq_len / "
            "train.micro_batch_size"
        )
    return (
        f"raise modules.{name}.parallel.sp, set modules.{name}.activation_checkpointing=full, "
        f"or lower modules.{name}.seq_len"
    )


def oom_advice(plan: Plan) -> list[str]:
    """Empty when the plan fits; else lines naming the fullest GPU's two largest consumers and fixes."""
    if plan.fits:
        return []
    worst = min(plan.devices, key=lambda d: d.margin)
    parts: list[tuple[int, str, str]] = []
    for key, size in worst.peak_terms.items():
        name, _, term = key.partition(".")
        component = term if term in ("params", "grads", "optimizer") else "activations"
        parts.append((size, name, component))
    parts.sort(reverse=True)
    lines = [
        f"GPU {worst.global_gpu} is over by {-worst.margin / 2**30:.2f} GiB at its peak phase "
        f"({worst.peak_phase}); its largest consumers there:"
    ]
    for size, name, component in parts[:2]:
        known = any(g.name == name for g in plan.groups)
        act = _activation_knob(plan, name) if component == "activations" and known else None
        knob = act or _KNOBS.get(component, "use more GPUs")
        lines.append(f"  {name} {component} {size / 2**30:.2f} GiB. Fix: {knob}")
    return lines
