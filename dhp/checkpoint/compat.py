"""Can a checkpoint resume under the current config and plan? Decided on the driver from meta.json.

Resharding (another TP/SP/DP degree, another rank count, collocated <-> disaggregated) is allowed:
DCP stores logical tensors and each group reads the shards it now owns. What cannot be bridged is
refused with a CheckpointError that names the difference.
"""

from __future__ import annotations

from dhp.checkpoint.meta import CheckpointMeta, ModuleRecord, stable_hash
from dhp.config.schema import ModuleConfig
from dhp.errors import CheckpointError


def _group_meshes(plan: dict) -> dict[str, dict]:
    return {g["name"]: g["mesh"] for g in plan["groups"]}


def check_resume_compatible(
    meta: CheckpointMeta,
    *,
    plan: dict,
    modules: dict[str, ModuleConfig],
    model_hash: str,
) -> list[str]:
    """Raise CheckpointError when ``meta`` cannot resume this run; return notes on what gets resharded.

    ``plan`` is ``Plan.to_json()`` of the new run, ``modules`` its ``RunConfig.modules`` and
    ``model_hash`` the ``stable_hash`` of its ``ModelConfig`` architecture (``vision``, ``llm``).
    """
    problems: list[str] = []
    if set(meta.modules) != set(modules):
        problems.append(
            f"module groups differ: checkpoint has {sorted(meta.modules)}, this run has {sorted(modules)}"
        )
    if meta.model_hash != model_hash:
        problems.append(
            f"model architecture differs (model hash {meta.model_hash} in the checkpoint, {model_hash} now): "
            "model.vision / model.llm numbers must equal the ones the checkpoint was trained with"
        )
    for name in sorted(set(meta.modules) & set(modules)):
        rec = meta.modules[name]
        if rec.frozen and not rec.has_optimizer and not modules[name].freeze:
            problems.append(
                f"modules.{name}: frozen when saved (no optimizer state) but `freeze: false` now; "
                f"set modules.{name}.freeze=true to resume"
            )
    if problems:
        raise CheckpointError(
            "cannot resume from this checkpoint:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\n  Fix: resume with the checkpoint's model and modules, or start a new run (train.resume=null)."
        )
    notes = []
    old, new = _group_meshes(meta.plan), _group_meshes(plan)
    for name in sorted(modules):
        if old.get(name) != new.get(name):
            notes.append(
                f"{name}: resharding mesh {old.get(name)} -> {new.get(name)} (RNG not restored exactly)"
            )
    return notes


def model_arch_hash(model) -> str:
    """``stable_hash`` of what fixes the tensors' names and shapes: family, vision/llm numbers, tokens.

    ``model`` is the run's ModelConfig (dataclass or OmegaConf); dtype, attention kernel and weight
    path are left out on purpose: a run may resume in another dtype or from a copied directory.
    """
    return stable_hash(
        {"family": model.family, "vision": model.vision, "llm": model.llm, "tokens": model.tokens}
    )


def module_records(modules, *, world_sizes: dict[str, int]) -> dict[str, ModuleRecord]:
    """``meta.modules`` for ``RunConfig.modules`` and each group's world size (from the plan)."""
    return {
        name: ModuleRecord(world_size=world_sizes[name], frozen=m.freeze, has_optimizer=not m.freeze)
        for name, m in modules.items()
    }
