"""``dhp plan --auto``: run the search, print the top plans and the winner's reason, save a recipe."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from dhp.plan.compile import compile_plan
from dhp.plan.search import Candidate, apply, auto_plan
from dhp.plan.types import Plan

GIB = float(1 << 30)


def top_table(ranked: list[tuple[Candidate, list[str]]]) -> Table:
    table = Table(title="dhp plan --auto: the fastest plans that fit (predicted)")
    for col in ("#", "plan", "step s", "peak GiB", "bottleneck"):
        table.add_column(col, justify="left" if col in ("plan", "bottleneck") else "right")
    for i, (c, _) in enumerate(ranked, 1):
        table.add_row(str(i), c.label(), f"{c.step_s:.3f}", f"{c.peak / GIB:.2f}", c.bottleneck)
    return table


def save_recipe(config: DictConfig, path: str, *, why: str) -> Path:
    """Write ``config`` as a complete recipe that ``dhp train conf=PATH`` runs unchanged."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = f"# Written by `dhp plan --auto`: {why}\n"
    out.write_text(header + OmegaConf.to_yaml(config), encoding="utf-8")
    return out


AUTO_SUFFIX = "_auto"


def auto_name(name: str) -> str:
    """The run name of a saved auto plan: ``<name>_auto``, so its run dirs and checkpoints live apart
    from the original recipe's and ``train.resume=auto`` of either never picks up the other's."""
    return name if name.endswith(AUTO_SUFFIX) else name + AUTO_SUFFIX


def run_auto(
    config: DictConfig, fixed: set[str], *, save: str | None, worst_case: bool = False
) -> tuple[Plan, list, str]:
    """Search, compile the winner and optionally save it; returns (winner plan, ranked, reason).
    ``worst_case``: :func:`dhp.plan.search.auto_plan`'s.

    The saved recipe runs under :func:`auto_name` (``name=`` given on the command line is kept
    as the user wrote it: it is theirs to choose).
    """
    ranked, why = auto_plan(config, fixed, worst_case=worst_case)
    best = ranked[0][0]
    chosen = apply(config, ranked[0][1])
    OmegaConf.set_readonly(chosen, False)
    chosen.description = f"dhp plan --auto: {best.label()}"
    if save and "name" not in fixed:
        chosen.name = auto_name(str(chosen.name))
    OmegaConf.set_readonly(chosen, True)
    plan = compile_plan(chosen)
    if save:
        save_recipe(chosen, save, why=why)
    return plan, ranked, why


def render_auto(ranked: list, why: str, plan: Plan, console: Console) -> None:
    table = top_table(ranked)
    est = plan.estimate
    console.print(table)
    console.print(f"winner: {ranked[0][0].label()}\n  {why}")
    if est is not None:
        console.print(
            f"  estimate ({est['profile']}; {est['provenance']}): {est['step_time_s']:.3f} s/step, "
            f"{est['vision_tokens_per_s']:.0f} encoder tok/s, {est['text_tokens_per_s']:.0f} text tok/s"
        )
    console.print("  overrides: " + " ".join(ranked[0][1]))
